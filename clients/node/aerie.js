'use strict';
/**
 * A minimal aerie client for Node.js: loads the gRPC contract from the repository's proto/ files at
 * run time (no generated code) and exposes the Coordinator service.
 *
 *   const { connect } = require('./aerie');
 *   const coordinator = connect('localhost:50051');
 *   for await (const msg of coordinator.Generate({ prompt_ids: [1, 2, 3], max_new_tokens: 20 })) {
 *     process.stdout.write(msg.tokens.join(' ') + ' ');
 *   }
 *
 * Field names are the proto's own (keepCase), int64 fields arrive as JS numbers (token ids and
 * counts are far below 2^53), enums as their names. This module does not parse arguments or print.
 *
 * TLS and tokens (security.js reads them from AERIE_TLS_CA / AERIE_API_TOKEN ...):
 *   const sec = clientSecurity();
 *   const coordinator = connect('aerie.example:50051', { tls: true, ...sec });
 *   coordinator.Generate(request, callMetadata(sec.token), { deadline: deadlineIn(60) });
 */

const path = require('path');
const fs = require('fs');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

// proto/ of the repository this client lives in; override with $AERIE_PROTO_DIR when it is copied out.
const DEFAULT_PROTO_DIR = path.resolve(__dirname, '..', '..', 'proto');
const COORDINATOR_PROTO = path.join('aerie', 'v1', 'coordinator.proto');

function loadPackage(protoDir = process.env.AERIE_PROTO_DIR || DEFAULT_PROTO_DIR) {
  const file = path.join(protoDir, COORDINATOR_PROTO);
  if (!fs.existsSync(file)) {
    throw new Error(`${file} not found: run from the aerie repository or set AERIE_PROTO_DIR to its proto/ directory`);
  }
  const definition = protoLoader.loadSync(COORDINATOR_PROTO, {
    includeDirs: [protoDir],
    keepCase: true, // prompt_ids, max_new_tokens, ... exactly as in the .proto
    longs: Number,
    enums: String,
    defaults: true, // absent repeated fields arrive as [] rather than undefined
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).aerie.v1;
}

/**
 * A Coordinator client. `address` is host:port. TLS when `tls` is true or a `ca` is given: the
 * server's certificate is checked against `ca` (PEM bytes; default the system's root certificates)
 * and `serverName` (default the address's host); `cert` + `key` (PEM bytes) present a client
 * certificate. Default message size limits are raised to match the services' AERIE_MAX_MESSAGE_BYTES range.
 */
function connect(address, { tls = false, ca, cert, key, serverName, protoDir,
  maxMessageBytes = 64 * 1024 * 1024 } = {}) {
  const aerie = loadPackage(protoDir);
  const secure = tls || ca !== undefined;
  const credentials = secure ? grpc.credentials.createSsl(ca || null, key || null, cert || null)
    : grpc.credentials.createInsecure();
  const options = {
    'grpc.max_receive_message_length': maxMessageBytes,
    'grpc.max_send_message_length': maxMessageBytes,
  };
  if (secure && serverName) options['grpc.ssl_target_name_override'] = serverName;
  return new aerie.Coordinator(address, credentials, options);
}

/** The call metadata carrying an API token (`authorization: Bearer <token>`); empty without one. */
function callMetadata(token) {
  const metadata = new grpc.Metadata();
  if (token) metadata.set('authorization', `Bearer ${token}`);
  return metadata;
}

/** A deadline `seconds` from now, for the call options of any RPC. */
function deadlineIn(seconds) {
  return new Date(Date.now() + seconds * 1000);
}

/** The grpc.status name of a numeric status code (e.g. 14 -> "UNAVAILABLE"). */
function statusName(code) {
  return Object.keys(grpc.status).find((k) => grpc.status[k] === code) || String(code);
}

module.exports = { connect, callMetadata, loadPackage, deadlineIn, statusName, grpc, DEFAULT_PROTO_DIR };

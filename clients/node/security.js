'use strict';
/**
 * TLS and API tokens for the Node clients, from the same environment as `aerie generate --coordinator`
 * (docs/security.md), so no secret is ever passed on a command line:
 *
 *   AERIE_TLS_CA            a PEM file: the CA that signed the server's certificate (implies TLS)
 *   AERIE_TLS_CERT/_KEY     PEM files: a client certificate and key (mTLS; optional)
 *   AERIE_TLS_SERVER_NAME   check the server's certificate against this name instead of the host
 *   AERIE_API_TOKEN         the bearer token (`Authorization: Bearer <token>`); chat.js also reads
 *                           OPENAI_API_KEY when AERIE_API_TOKEN is unset
 *
 * A file that cannot be read is an error naming the variable and the path. This module does no I/O
 * beyond reading those files.
 */

const fs = require('fs');

class ConfigError extends Error {}

function readPem(env, name) {
  const file = env[name];
  if (!file) return undefined;
  try {
    return fs.readFileSync(file);
  } catch (e) {
    throw new ConfigError(`${name}=${file}: cannot read it (${e.code || e.message})`);
  }
}

/** { ca, cert, key, serverName, token } from `env` (process.env by default); absent ones undefined. */
function clientSecurity(env = process.env, { openaiKey = false } = {}) {
  const out = {
    ca: readPem(env, 'AERIE_TLS_CA'),
    cert: readPem(env, 'AERIE_TLS_CERT'),
    key: readPem(env, 'AERIE_TLS_KEY'),
    serverName: env.AERIE_TLS_SERVER_NAME || undefined,
    token: env.AERIE_API_TOKEN || (openaiKey ? env.OPENAI_API_KEY : undefined) || undefined,
  };
  if (Boolean(out.cert) !== Boolean(out.key)) {
    throw new ConfigError('a client certificate needs both AERIE_TLS_CERT and AERIE_TLS_KEY');
  }
  return out;
}

module.exports = { clientSecurity, ConfigError };

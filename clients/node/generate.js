#!/usr/bin/env node
'use strict';
/**
 * Stream a generation from an aerie coordinator and print it as it arrives.
 *
 *   node clients/node/generate.js --coordinator localhost:50051 --prompt 'Hello' --max-new-tokens 20
 *   node clients/node/generate.js --coordinator localhost:50051 --prompt 'Hi!' --chat --stop '\n'
 *   node clients/node/generate.js --coordinator localhost:50051 --prompt-ids 1,2,3 --temperature 0.7 --json
 *
 * The prompt is text (--prompt; tokenized on the coordinator, --chat sends it as one user message
 * through the model's chat template) or token ids (--prompt-ids). Without --json the new text goes to
 * stdout as each committed round arrives (token ids, space-separated, for --prompt-ids or --ids), and a
 * summary line goes to stderr. With --json, one JSON object is printed at the end:
 *   {"sequence_id", "tokens", "text", "finish_reason", "accept_lengths", "rounds", "tau", "info"}
 * (tokens, text, finish_reason, accept_lengths, rounds and tau mean what they mean in `aerie generate
 * --json`). --stop (repeatable) ends the text before a stop string. Ctrl-C cancels the sequence on the
 * coordinator. Exit codes: 0 done, 1 RPC error, 2 bad arguments, 130 interrupted. This client needs no
 * tokenizer: the coordinator tokenizes and detokenizes.
 *
 * TLS and the API token come from the environment (security.js: AERIE_TLS_CA, AERIE_TLS_CERT/KEY,
 * AERIE_TLS_SERVER_NAME, AERIE_API_TOKEN), never from arguments; --tls without AERIE_TLS_CA checks the
 * server against the system's root certificates.
 */

const { connect, callMetadata, deadlineIn, statusName, grpc } = require('./aerie');
const { clientSecurity, ConfigError } = require('./security');

const USAGE = `usage: generate.js --coordinator HOST:PORT (--prompt TEXT [--chat] | --prompt-ids 1,2,3)
                   [--max-new-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
                   [--stop STRING]... [--stop-token-ids 5,6] [--ignore-eos] [--sequence-id ID]
                   [--ids] [--timeout SECONDS] [--tls] [--json]
TLS and token from the environment: AERIE_TLS_CA, AERIE_TLS_CERT, AERIE_TLS_KEY, AERIE_TLS_SERVER_NAME, AERIE_API_TOKEN`;

class UsageError extends Error {}

// flag -> [kind, default]; kinds: string, strings (repeatable), int, float, ids, bool
const FLAGS = {
  '--coordinator': ['string', undefined],
  '--prompt': ['string', undefined],
  '--chat': ['bool', false],
  '--prompt-ids': ['ids', undefined],
  '--stop': ['strings', []],
  '--ids': ['bool', false],
  '--max-new-tokens': ['int', undefined],
  '--temperature': ['float', 0],
  '--top-p': ['float', undefined],
  '--top-k': ['int', 0],
  '--seed': ['int', 0],
  '--stop-token-ids': ['ids', []],
  '--ignore-eos': ['bool', false],
  '--sequence-id': ['string', ''],
  '--timeout': ['float', 600],
  '--tls': ['bool', false],
  '--json': ['bool', false],
};

function parseValue(flag, kind, text) {
  if (kind === 'string') return text;
  if (kind === 'ids') {
    if (text.trim() === '') return [];
    const ids = text.split(',').map((s) => s.trim());
    if (!ids.every((s) => /^\d+$/.test(s))) throw new UsageError(`${flag} must be comma-separated integers; got ${JSON.stringify(text)}`);
    return ids.map(Number);
  }
  const n = Number(text);
  if (text.trim() === '' || !Number.isFinite(n) || (kind === 'int' && !Number.isInteger(n))) {
    throw new UsageError(`${flag} must be ${kind === 'int' ? 'an integer' : 'a number'}; got ${JSON.stringify(text)}`);
  }
  return n;
}

function parseArgs(argv) {
  const opts = {};
  for (const [flag, [, def]] of Object.entries(FLAGS)) opts[flag] = def;
  for (let i = 0; i < argv.length; i++) {
    let arg = argv[i];
    if (arg === '-h' || arg === '--help') {
      process.stdout.write(USAGE + '\n');
      process.exit(0);
    }
    let inline;
    if (arg.includes('=')) [arg, inline] = [arg.slice(0, arg.indexOf('=')), arg.slice(arg.indexOf('=') + 1)];
    if (!(arg in FLAGS)) throw new UsageError(`unknown argument ${arg}`);
    const [kind] = FLAGS[arg];
    if (kind === 'bool') {
      opts[arg] = true;
      continue;
    }
    const text = inline !== undefined ? inline : argv[++i];
    if (text === undefined) throw new UsageError(`${arg} needs a value`);
    if (kind === 'strings') opts[arg] = [...opts[arg], text];
    else opts[arg] = parseValue(arg, kind, text);
  }
  if (!opts['--coordinator']) throw new UsageError('--coordinator is required');
  const hasIds = opts['--prompt-ids'] !== undefined && opts['--prompt-ids'].length > 0;
  if (opts['--prompt'] !== undefined && hasIds) throw new UsageError('give --prompt or --prompt-ids, not both');
  if (opts['--prompt'] === undefined && !hasIds) throw new UsageError('--prompt or --prompt-ids is required');
  if (opts['--chat'] && opts['--prompt'] === undefined) throw new UsageError('--chat needs --prompt');
  return opts;
}

function buildRequest(opts) {
  const sampling = { temperature: opts['--temperature'], top_k: opts['--top-k'], seed: opts['--seed'] };
  if (opts['--top-p'] !== undefined) sampling.top_p = opts['--top-p'];
  const request = {
    sampling,
    stop: opts['--stop'],
    stop_token_ids: opts['--stop-token-ids'],
    ignore_eos: opts['--ignore-eos'],
    sequence_id: opts['--sequence-id'],
  };
  if (opts['--max-new-tokens'] !== undefined) request.max_new_tokens = opts['--max-new-tokens'];
  if (opts['--prompt'] === undefined) request.prompt_ids = opts['--prompt-ids'];
  else if (opts['--chat']) request.messages = [{ role: 'user', content: opts['--prompt'] }];
  else request.prompt = opts['--prompt'];
  return request;
}

async function main(argv) {
  let opts;
  try {
    opts = parseArgs(argv);
  } catch (e) {
    if (!(e instanceof UsageError)) throw e;
    process.stderr.write(`${USAGE}\ngenerate.js: error: ${e.message}\n`);
    return 2;
  }
  let security;
  try {
    security = clientSecurity();
  } catch (e) {
    if (!(e instanceof ConfigError)) throw e;
    process.stderr.write(`generate.js: error: ${e.message}\n`);
    return 2;
  }
  const json = opts['--json'];
  const printIds = opts['--ids'] || opts['--prompt'] === undefined;
  const coordinator = connect(opts['--coordinator'], { tls: opts['--tls'], ...security });
  const metadata = callMetadata(security.token);
  const call = coordinator.Generate(buildRequest(opts), metadata, { deadline: deadlineIn(opts['--timeout']) });

  const result = { sequence_id: '', tokens: [], text: '', finish_reason: null, accept_lengths: [], rounds: 0, tau: null,
    info: null };
  let interrupted = false;
  process.once('SIGINT', () => {
    interrupted = true;
    // Ask the coordinator to stop the sequence (it frees KV), then drop the stream.
    if (result.sequence_id) {
      coordinator.Cancel({ sequence_id: result.sequence_id }, metadata, { deadline: deadlineIn(5) }, () => call.cancel());
    } else {
      call.cancel();
    }
  });

  const started = process.hrtime.bigint();
  try {
    for await (const msg of call) {
      if (msg.sequence_id) result.sequence_id = msg.sequence_id;
      if (msg.info && !result.info) result.info = msg.info;
      // round_index (0 = prefill); an older coordinator fills only the deprecated `index`
      const roundIndex = msg.stats ? (msg.stats.round_index || msg.stats.index) : 0;
      if (roundIndex > 0) result.accept_lengths.push(msg.stats.accept_length);
      result.tokens.push(...msg.tokens);
      result.text += msg.text;
      if (msg.finish_reason) result.finish_reason = msg.finish_reason;
      if (!json && printIds && msg.tokens.length) process.stdout.write(msg.tokens.join(' ') + ' ');
      if (!json && !printIds && msg.text) process.stdout.write(msg.text);
    }
    if (interrupted) {
      // Ctrl-C raced the end of the stream (the last round arrived before the cancel took effect):
      // the user still interrupted, so report it as such.
      if (!json) process.stdout.write('\n');
      process.stderr.write(`[cancelled ${result.sequence_id || ''} after ${result.tokens.length} tokens]\n`);
      return 130;
    }
  } catch (e) {
    if (interrupted && e.code === grpc.status.CANCELLED) {
      if (!json) process.stdout.write('\n');
      process.stderr.write(`[cancelled ${result.sequence_id || ''} after ${result.tokens.length} tokens]\n`);
      return 130;
    }
    if (!json) process.stdout.write('\n');
    process.stderr.write(`generate.js: error: ${statusName(e.code)}: ${e.details || e.message}\n`);
    return 1;
  } finally {
    coordinator.close();
  }

  const seconds = Number(process.hrtime.bigint() - started) / 1e9;
  result.rounds = result.accept_lengths.length;
  result.tau = result.rounds ? result.accept_lengths.reduce((a, b) => a + b, 0) / result.rounds : null;
  if (json) {
    process.stdout.write(JSON.stringify(result) + '\n');
  } else {
    process.stdout.write('\n');
    const tau = result.tau === null ? '-' : result.tau.toFixed(2);
    const rate = seconds > 0 ? (result.tokens.length / seconds).toFixed(1) : '-';
    process.stderr.write(`[${result.tokens.length} tokens, ${result.rounds} rounds, tau ${tau}, ${rate} tok/s, ` +
      `finish: ${result.finish_reason}, sequence ${result.sequence_id}]\n`);
  }
  return 0;
}

if (require.main === module) {
  main(process.argv.slice(2)).then((code) => { process.exitCode = code; }, (e) => {
    process.stderr.write(`generate.js: error: ${e.message}\n`);
    process.exitCode = 1;
  });
}

module.exports = { parseArgs, buildRequest, main };

#!/usr/bin/env node
'use strict';
/**
 * Chat with aerie's OpenAI-compatible HTTP API from Node.js (>= 18, no packages: node's http/https),
 * printing the answer as it streams (server-sent events).
 *
 *   node clients/node/chat.js --url http://127.0.0.1:8000/v1 --prompt 'What is the capital of France?'
 *   node clients/node/chat.js --url http://127.0.0.1:8000/v1 --prompt 'Hi' --max-tokens 50 --temperature 0 --json
 *
 * --json prints {"text", "finish_reason", "usage"} at the end instead of streaming the text. Exit codes:
 * 0 done (also --help), 1 HTTP, connection or stream error (the server's OpenAI-style message, or the
 * URL and the system's reason), 2 bad arguments. TLS and the token come from the environment
 * (security.js; never from arguments): an https:// URL is checked against AERIE_TLS_CA (default: the
 * system's roots), and AERIE_API_TOKEN (or OPENAI_API_KEY) is sent as `Authorization: Bearer`.
 */

const http = require('http');
const https = require('https');
const tls = require('tls');
const { clientSecurity, ConfigError } = require('./security');

const USAGE = `usage: chat.js --url BASE_URL --prompt TEXT [--model NAME] [--max-tokens N] [--temperature T] [--json]
TLS and token from the environment: AERIE_TLS_CA, AERIE_TLS_CERT, AERIE_TLS_KEY, AERIE_TLS_SERVER_NAME,
AERIE_API_TOKEN (or OPENAI_API_KEY); an https:// URL without AERIE_TLS_CA uses the system's root certificates`;

class UsageError extends Error {}

function parseArgs(argv) {
  const opts = { url: 'http://127.0.0.1:8000/v1', prompt: undefined, model: undefined, maxTokens: undefined,
    temperature: undefined, json: false, help: false };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    const next = () => {
      if (argv[i + 1] === undefined) throw new UsageError(`${arg} needs a value`);
      return argv[++i];
    };
    const number = (text) => {
      const n = Number(text);
      if (text.trim() === '' || !Number.isFinite(n)) throw new UsageError(`${arg} must be a number; got ${JSON.stringify(text)}`);
      return n;
    };
    if (arg === '-h' || arg === '--help') opts.help = true;
    else if (arg === '--url') opts.url = next().replace(/\/+$/, '');
    else if (arg === '--prompt') opts.prompt = next();
    else if (arg === '--model') opts.model = next();
    else if (arg === '--max-tokens') opts.maxTokens = number(next());
    else if (arg === '--temperature') opts.temperature = number(next());
    else if (arg === '--json') opts.json = true;
    else throw new UsageError(`unknown argument ${arg}`);
  }
  if (!opts.help && opts.prompt === undefined) throw new UsageError('--prompt is required');
  if (!/^https?:\/\//.test(opts.url)) throw new UsageError(`--url must start with http:// or https://; got ${opts.url}`);
  return opts;
}

/**
 * One HTTP(S) request -> the response (an IncomingMessage: a stream of bytes). A connection failure
 * rejects with the URL and the system's reason ("connect ECONNREFUSED 127.0.0.1:8000"), not fetch's
 * bare "fetch failed". `security`: clientSecurity()'s CA, client certificate and server name.
 */
function request(url, { method = 'GET', headers = {}, body, security = {} } = {}) {
  const target = new URL(url);
  const secure = target.protocol === 'https:';
  const options = { method, headers: { ...headers } };
  if (security.token) options.headers.Authorization = `Bearer ${security.token}`;
  if (body !== undefined) {
    options.headers['Content-Type'] = 'application/json';
    options.headers['Content-Length'] = Buffer.byteLength(body);
  }
  if (secure) {
    Object.assign(options, { ca: security.ca, cert: security.cert, key: security.key });
    if (security.serverName) {
      options.servername = security.serverName;
      options.checkServerIdentity = (_host, cert) => tls.checkServerIdentity(security.serverName, cert);
    }
  }
  return new Promise((resolve, reject) => {
    const req = (secure ? https : http).request(target, options, resolve);
    req.on('error', (e) => reject(new Error(`cannot reach ${url}: ${e.message}${e.code && !e.message.includes(e.code) ? ` (${e.code})` : ''}`)));
    req.end(body);
  });
}

/** The whole body of `res` as text (bytes joined before decoding: multi-byte characters stay whole). */
async function readText(res) {
  const parts = [];
  for await (const bytes of res) parts.push(bytes);
  return Buffer.concat(parts).toString('utf8');
}

/** A non-2xx response's OpenAI-style error message (or the status line when the body is not one). */
async function errorMessage(res) {
  const text = await readText(res);
  try {
    return `HTTP ${res.statusCode}: ${JSON.parse(text).error.message}`;
  } catch (e) {
    return `HTTP ${res.statusCode} ${res.statusMessage}${text ? `: ${text.slice(0, 200)}` : ''}`;
  }
}

async function main(argv) {
  let opts;
  let security;
  try {
    opts = parseArgs(argv);
    security = clientSecurity(process.env, { openaiKey: true });
  } catch (e) {
    if (!(e instanceof UsageError) && !(e instanceof ConfigError)) throw e;
    process.stderr.write(`${USAGE}\nchat.js: error: ${e.message}\n`);
    return 2;
  }
  if (opts.help) {
    process.stdout.write(USAGE + '\n');
    return 0;
  }
  let model = opts.model;
  if (model === undefined) { // the one model the server serves
    const res = await request(`${opts.url}/models`, { security });
    if (res.statusCode !== 200) {
      process.stderr.write(`chat.js: error: ${await errorMessage(res)}\n`);
      return 1;
    }
    model = JSON.parse(await readText(res)).data[0].id;
  }
  const body = { model, messages: [{ role: 'user', content: opts.prompt }], stream: true,
    stream_options: { include_usage: true } };
  if (opts.maxTokens !== undefined) body.max_tokens = opts.maxTokens;
  if (opts.temperature !== undefined) body.temperature = opts.temperature;
  const res = await request(`${opts.url}/chat/completions`, { method: 'POST', body: JSON.stringify(body), security });
  if (res.statusCode !== 200) {
    process.stderr.write(`chat.js: error: ${await errorMessage(res)}\n`);
    return 1;
  }
  const result = { text: '', finish_reason: null, usage: null };
  const decoder = new TextDecoder(); // ONE decoder for the stream: a character split across chunks stays whole
  let buffered = '';
  for await (const bytes of res) { // server-sent events: "data: {...}\n\n", then "data: [DONE]"
    buffered += decoder.decode(bytes, { stream: true });
    let end;
    while ((end = buffered.indexOf('\n\n')) >= 0) {
      const event = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      if (!event.startsWith('data: ') || event === 'data: [DONE]') continue;
      const chunk = JSON.parse(event.slice(6));
      if (chunk.error) {
        process.stderr.write(`chat.js: error: ${chunk.error.message}\n`);
        return 1;
      }
      if (chunk.usage) result.usage = chunk.usage;
      for (const choice of chunk.choices) {
        const text = choice.delta.content || '';
        result.text += text;
        if (!opts.json) process.stdout.write(text);
        if (choice.finish_reason) result.finish_reason = choice.finish_reason;
      }
    }
  }
  process.stdout.write(opts.json ? JSON.stringify(result) + '\n' : '\n');
  return 0;
}

if (require.main === module) {
  main(process.argv.slice(2)).then((code) => { process.exitCode = code; }, (e) => {
    process.stderr.write(`chat.js: error: ${e.message}\n`);
    process.exitCode = 1;
  });
}

module.exports = { parseArgs, request, main };

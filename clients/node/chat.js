#!/usr/bin/env node
'use strict';
/**
 * Chat with aerie's OpenAI-compatible HTTP API from Node.js (>= 18: built-in fetch, no packages),
 * printing the answer as it streams (server-sent events).
 *
 *   node clients/node/chat.js --url http://127.0.0.1:8000/v1 --prompt 'What is the capital of France?'
 *   node clients/node/chat.js --url http://127.0.0.1:8000/v1 --prompt 'Hi' --max-tokens 50 --temperature 0 --json
 *
 * --json prints {"text", "finish_reason", "usage"} at the end instead of streaming the text. Exit codes:
 * 0 done, 1 HTTP or stream error (the server's OpenAI-style message is printed), 2 bad arguments.
 */

const USAGE = 'usage: chat.js --url BASE_URL --prompt TEXT [--model NAME] [--max-tokens N] [--temperature T] [--json]';

function parseArgs(argv) {
  const opts = { url: 'http://127.0.0.1:8000/v1', prompt: undefined, model: undefined, maxTokens: undefined,
    temperature: undefined, json: false };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    const next = () => {
      if (argv[i + 1] === undefined) throw new Error(`${arg} needs a value`);
      return argv[++i];
    };
    if (arg === '--url') opts.url = next();
    else if (arg === '--prompt') opts.prompt = next();
    else if (arg === '--model') opts.model = next();
    else if (arg === '--max-tokens') opts.maxTokens = Number(next());
    else if (arg === '--temperature') opts.temperature = Number(next());
    else if (arg === '--json') opts.json = true;
    else throw new Error(`unknown argument ${arg}`);
  }
  if (opts.prompt === undefined) throw new Error('--prompt is required');
  return opts;
}

async function main(argv) {
  let opts;
  try {
    opts = parseArgs(argv);
  } catch (e) {
    process.stderr.write(`${USAGE}\nchat.js: error: ${e.message}\n`);
    return 2;
  }
  let model = opts.model;
  if (model === undefined) { // the one model the server serves
    const models = await (await fetch(`${opts.url}/models`)).json();
    model = models.data[0].id;
  }
  const body = { model, messages: [{ role: 'user', content: opts.prompt }], stream: true,
    stream_options: { include_usage: true } };
  if (opts.maxTokens !== undefined) body.max_tokens = opts.maxTokens;
  if (opts.temperature !== undefined) body.temperature = opts.temperature;
  const res = await fetch(`${opts.url}/chat/completions`, {
    method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body),
  });
  if (!res.ok) {
    const err = await res.json().catch(() => ({ error: { message: res.statusText } }));
    process.stderr.write(`chat.js: error: HTTP ${res.status}: ${err.error.message}\n`);
    return 1;
  }
  const result = { text: '', finish_reason: null, usage: null };
  const decoder = new TextDecoder();
  let buffered = '';
  for await (const bytes of res.body) { // server-sent events: "data: {...}\n\n", then "data: [DONE]"
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

module.exports = { parseArgs, main };

#!/usr/bin/env node
// A Node.js client of seqserve's public gRPC API (protos/seqserve/v1/generate.proto),
// written with @grpc/grpc-js and @grpc/proto-loader only, so the API is exercised by a
// gRPC implementation other than the one the server and the Python client use.
//
//   node generate.js --address 127.0.0.1:8000 --prompt "Once upon a time" --max-new-tokens 20
//
// Calls the server-streaming Generate RPC, puts the text and token ids back together from
// every message (one token in `token`, or several in `tokens`/`token_texts` when the
// stream fell behind) and prints one JSON line:
//   {"request_id", "token_ids", "text", "finish_reason", "usage", "messages",
//    "tokens_per_message", "health"}
// `--pause-ms MS` stops reading after the first token message for MS milliseconds, so
// that tokens pile up on the server and come back several to a message. They pile up
// only once the buffers between the server's writes and this client are full (tens of
// KiB and more): `--window BYTES` (a small HTTP/2 flow-control window) and large messages
// (a long `--request-id`, echoed in every message) fill them sooner. `--health` first asks
// grpc.health.v1 for the readiness and liveness names. Exits 1 with the gRPC status on stderr when a call fails,
// 2 on bad arguments, 3 when a message breaks the proto's rules.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const healthCheck = require('grpc-health-check');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'protos');
const GENERATE_PROTO = 'seqserve/v1/generate.proto';
// keepCase: the proto's own field names; defaults: an unset message field reads as null,
// so `token` (unset on multi-token and final messages) is told apart from token id 0.
const LOADER_OPTIONS = { keepCase: true, longs: String, enums: String, defaults: true,
                         oneofs: true, arrays: true };
const FINISH_REASONS = { FINISH_REASON_LENGTH: 'length', FINISH_REASON_EOS: 'eos',
                         FINISH_REASON_STOP: 'stop' };
// The names seqserve's health service answers (seqserve_common/health.py).
const HEALTH_NAMES = ['', 'readiness', 'liveness', 'seqserve.v1.Generation'];

const USAGE = `usage: node generate.js --address HOST:PORT --prompt TEXT [--max-new-tokens N]
  [--decoding-strategy greedy|sample|contrastive] [--seed N] [--ignore-eos]
  [--request-id ID] [--pause-ms MS] [--window BYTES] [--health] [--timeout-s S]
  [--token BEARER]`;

class ProtocolError extends Error {}

function parseArgs(argv) {
  const args = { address: '127.0.0.1:8000', prompt: null, maxNewTokens: null,
                 decodingStrategy: null, seed: null, ignoreEos: false, pauseMs: 0,
                 window: null, health: false, timeoutS: 120, token: null, requestId: '' };
  const flags = { '--address': 'address', '--prompt': 'prompt',
                  '--max-new-tokens': 'maxNewTokens', '--decoding-strategy': 'decodingStrategy',
                  '--seed': 'seed', '--pause-ms': 'pauseMs', '--window': 'window',
                  '--timeout-s': 'timeoutS', '--token': 'token', '--request-id': 'requestId' };
  const numeric = new Set(['maxNewTokens', 'seed', 'pauseMs', 'window', 'timeoutS']);
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === '--ignore-eos') { args.ignoreEos = true; continue; }
    if (a === '--health') { args.health = true; continue; }
    if (a === '--help' || a === '-h') { console.log(USAGE); process.exit(0); }
    const key = flags[a];
    if (!key || i + 1 >= argv.length) throw new Error(`unknown flag or missing value: ${a}\n${USAGE}`);
    const value = argv[++i];
    if (numeric.has(key)) {
      const n = Number(value);
      if (!Number.isInteger(n) || n < 0) throw new Error(`${a} takes a whole number >= 0, got ${value}`);
      args[key] = n;
    } else {
      args[key] = value;
    }
  }
  if (args.prompt === null) throw new Error(`--prompt is required\n${USAGE}`);
  return args;
}

function callOptions(args) {
  return { deadline: new Date(Date.now() + args.timeoutS * 1000) };
}

function metadata(args) {
  const md = new grpc.Metadata();
  if (args.token) md.set('authorization', `Bearer ${args.token}`);
  return md;
}

function request(args) {
  const parameters = {};
  if (args.maxNewTokens !== null) parameters.max_new_tokens = args.maxNewTokens;
  if (args.decodingStrategy !== null) parameters.decoding_strategy = args.decodingStrategy;
  if (args.seed !== null) parameters.seed = String(args.seed);
  if (args.ignoreEos) parameters.ignore_eos = true;
  return { inputs: args.prompt, parameters, request_id: args.requestId };
}

// The token ids and texts one stream message carries, checked against the proto's rules:
// a message has `token` or `tokens`, never both, and one text per token in `tokens`
// whose concatenation is `text`.
function messageTokens(msg) {
  const many = msg.tokens || [];
  if (msg.token !== null && msg.token !== undefined) {
    if (many.length) throw new ProtocolError('a message has both token and tokens set');
    return [{ id: msg.token.id, text: msg.text }];
  }
  const texts = msg.token_texts || [];
  if (texts.length !== many.length) {
    throw new ProtocolError(`a message has ${many.length} tokens but ${texts.length} token_texts`);
  }
  if (many.length && texts.join('') !== msg.text) {
    throw new ProtocolError(`a message's text ${JSON.stringify(msg.text)} is not its ` +
                            `token_texts joined ${JSON.stringify(texts.join(''))}`);
  }
  return many.map((t, i) => ({ id: t.id, text: texts[i] }));
}

function generate(stub, args) {
  return new Promise((resolve, reject) => {
    const out = { request_id: '', token_ids: [], text: '', finish_reason: null, usage: null,
                  messages: 0, tokens_per_message: [] };
    const call = stub.Generate(request(args), metadata(args), callOptions(args));
    let paused = false;
    let failed = false;
    call.on('data', (msg) => {
      if (failed) return;
      try {
        if (out.finish_reason !== null) throw new ProtocolError('a message came after the final one');
        out.messages += 1;
        out.request_id = msg.request_id;
        const tokens = messageTokens(msg);
        out.tokens_per_message.push(tokens.length);
        for (const t of tokens) {
          out.token_ids.push(t.id);
          out.text += t.text;
        }
        if (msg.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
          if (tokens.length) throw new ProtocolError('the final message carries tokens');
          out.text += msg.text;  // text held back until the end (an incomplete character)
          out.finish_reason = FINISH_REASONS[msg.finish_reason] || msg.finish_reason;
          out.usage = msg.usage;
        } else if (!tokens.length) {
          throw new ProtocolError('a message carries neither tokens nor a finish reason');
        }
      } catch (err) {
        failed = true;
        call.cancel();
        reject(err);
        return;
      }
      // Read slowly once: stop reading after the first token so the server's writes
      // block on flow control and the tokens generated meanwhile pile up.
      if (args.pauseMs > 0 && !paused && out.token_ids.length) {
        paused = true;
        call.pause();
        setTimeout(() => call.resume(), args.pauseMs);
      }
    });
    call.on('error', (err) => { if (!failed) { failed = true; reject(err); } });
    call.on('end', () => {
      if (failed) return;
      if (out.finish_reason === null) reject(new ProtocolError('the stream ended without a final message'));
      else resolve(out);
    });
  });
}

function checkHealth(channelTarget, credentials, options, args) {
  const def = protoLoader.loadSync(healthCheck.protoPath, LOADER_OPTIONS);
  const Health = grpc.loadPackageDefinition(def).grpc.health.v1.Health;
  const client = new Health(channelTarget, credentials, options);
  const one = (service) => new Promise((resolve, reject) => {
    client.Check({ service }, metadata(args), callOptions(args), (err, reply) => {
      if (err) reject(err); else resolve([service, reply.status]);
    });
  });
  return Promise.all(HEALTH_NAMES.map(one))
    .then((pairs) => Object.fromEntries(pairs))
    .finally(() => client.close());
}

async function main() {
  let args;
  try {
    args = parseArgs(process.argv.slice(2));
  } catch (err) {
    console.error(err.message);
    process.exit(2);
  }
  const def = protoLoader.loadSync(GENERATE_PROTO, { ...LOADER_OPTIONS, includeDirs: [PROTO_ROOT] });
  const Generation = grpc.loadPackageDefinition(def).seqserve.v1.Generation;
  const options = {};
  if (args.window !== null) options['grpc-node.flow_control_window'] = args.window;
  const credentials = grpc.credentials.createInsecure();
  const stub = new Generation(args.address, credentials, options);
  try {
    const health = args.health ? await checkHealth(args.address, credentials, options, args) : null;
    const out = await generate(stub, args);
    out.health = health;
    process.stdout.write(JSON.stringify(out) + '\n');
  } catch (err) {
    if (err instanceof ProtocolError) {
      console.error(`protocol error: ${err.message}`);
      process.exitCode = 3;
    } else {
      console.error(`gRPC call failed: ${err.code !== undefined ? grpc.status[err.code] : ''} ${err.message}`);
      process.exitCode = 1;
    }
  } finally {
    stub.close();
  }
}

main();

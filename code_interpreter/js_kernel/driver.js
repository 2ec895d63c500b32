// The Node.js side of aenv's JavaScript kernel (code_interpreter/js_kernel/kernel.py).
//
// Cells arrive on stdin, one JSON object per line ({"id", "code"}); everything the kernel
// needs to know goes out on the pipe whose fd is argv[2], one JSON object per line:
// {"t": "stream", "name", "text"} for console and process.stdout/stderr output, then
// {"t": "done", "id", ...} with the cell's value (util.inspect) or its error. Cells run through Node's own REPL evaluator
// (repl.REPLServer#eval), so state persists between cells and top-level await works
// as in `node`'s REPL (and, as there, `let`/`const` cannot be declared twice). SIGINT
// (the kernel's interrupt) stops a synchronous loop (breakEvalOnSigint) or abandons an
// awaited promise; a loop that runs after an await cannot be stopped (the kernel then
// kills node: see kernel.py).
'use strict';

const fs = require('node:fs');
const repl = require('node:repl');
const util = require('node:util');
const { Console } = require('node:console');
const { PassThrough, Writable } = require('node:stream');

const CONTROL_FD = Number(process.argv[2] || 3);

function emit(message) {
  fs.writeSync(CONTROL_FD, JSON.stringify(message) + '\n');
}

function streamTo(name) {
  return new Writable({
    write(chunk, encoding, callback) {
      emit({ t: 'stream', name, text: chunk.toString() });
      callback();
    },
  });
}

const stdout = streamTo('stdout');
const stderr = streamTo('stderr');
// Direct writes to process.stdout / process.stderr go the same way (in order with console).
for (const [stream, target] of [[process.stdout, stdout], [process.stderr, stderr]]) {
  stream.write = (chunk, encoding, callback) => {
    emit({ t: 'stream', name: target === stdout ? 'stdout' : 'stderr', text: String(chunk) });
    if (typeof encoding === 'function') encoding();
    else if (typeof callback === 'function') callback();
    return true;
  };
}

const sink = new PassThrough();
sink.resume();
const server = repl.start({
  input: new PassThrough(),
  output: sink,
  terminal: false,
  prompt: '',
  useGlobal: false,
  breakEvalOnSigint: true,
});
server.context.console = new Console({ stdout, stderr });

let pending = null; // {id, settle} of the cell awaiting its value

// The REPL reports an error thrown while a cell runs through its domain, not the callback.
server._domain.on('error', (err) => {
  if (pending) pending.settle(err);
});

// SIGINT while a cell awaits: the cell ends as interrupted. While a cell's synchronous part
// runs, the listener is off: Node's vm then stops the script itself (breakEvalOnSigint; a
// 'SIGINT' listener during that time would let the signal kill the process instead).
function onSigint() {
  if (pending) pending.settle(Object.assign(new Error('Script execution was interrupted'), { name: 'Interrupted' }));
}
process.on('SIGINT', onSigint);

// The stack as far as the user's cells go (not the REPL's and this driver's frames).
function userStack(stack) {
  const lines = String(stack).split('\n');
  const cut = lines.findIndex((line, i) => i > 0 && /^\s+at /.test(line) && /\(node:|node:vm|driver\.js/.test(line));
  return (cut > 0 ? lines.slice(0, cut) : lines).join('\n');
}

function describeError(err) {
  if (err instanceof repl.Recoverable) err = err.err || new SyntaxError('Unexpected end of input');
  if (err && typeof err === 'object') {
    return { ename: String(err.name || 'Error'), evalue: String(err.message ?? ''), traceback: [userStack(err.stack || err)] };
  }
  return { ename: 'Error', evalue: String(err), traceback: [String(err)] };
}

function run(id, code) {
  return new Promise((resolve) => {
    let done = false;
    const settle = (err, value) => {
      if (done) return;
      done = true;
      pending = null;
      resolve([err, value]);
    };
    pending = { id, settle };
    process.removeListener('SIGINT', onSigint);
    try {
      server.eval(code, server.context, `cell-${id}`, (err, value) => {
        if (err) return settle(err);
        if (value && typeof value.then === 'function') {
          value.then((v) => settle(null, v), (e) => settle(e || new Error('Promise rejected')));
        } else {
          settle(null, value);
        }
      });
    } catch (err) {
      settle(err);
    } finally {
      process.on('SIGINT', onSigint);
    }
  });
}

let chain = Promise.resolve();
let buffer = '';
process.stdin.setEncoding('utf8');
process.stdin.on('data', (data) => {
  buffer += data;
  let newline;
  while ((newline = buffer.indexOf('\n')) >= 0) {
    const raw = buffer.slice(0, newline);
    buffer = buffer.slice(newline + 1);
    if (!raw.trim()) continue;
    const { id, code } = JSON.parse(raw);
    chain = chain.then(async () => {
      const [err, value] = await run(id, code);
      if (err) emit({ t: 'done', id, error: describeError(err) });
      else emit({ t: 'done', id, text: value === undefined ? null : util.inspect(value) });
    });
  }
});
process.stdin.on('end', () => process.exit(0));
emit({ t: 'ready' });

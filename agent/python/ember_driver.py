"""ember's per-context Python driver: one IPython InteractiveShell per process.

The agent (the guest's PID 1) starts this file in one of two modes:

* context mode (default): fd 1/2 are pipes the agent reads, fd 3 (``--fd``) is a control socket
  in the agent's framing (u32 LE length + JSON). The driver builds the shell, says ``ready`` and
  then serves ``run`` requests, one at a time, until the socket closes.
* ``--zygote``: the same, but it also serves ``fork`` requests. A fork request carries three
  descriptors (SCM_RIGHTS): a new control socket and the new context's stdout and stderr pipes.
  The zygote double-forks; the grandchild (re-parented to PID 1, which reaps everything) starts
  its own session, moves the pipes onto fd 1/2 and serves as a context on the new socket. The
  zygote imported IPython (and ran the template's warm-up code) once, so a fork costs
  milliseconds instead of the minute a cold ``import IPython`` takes in a kvm_pvm guest.

Messages, agent -> driver:
  {"op": "run", "code": str, "env": {k: v}?}
  {"op": "setup", "cwd": str?, "env": {k: v}?}            (context mode; answered with ready)
  {"op": "fork", "cwd": str?, "env": {k: v}?, "rewarm": bool} + 3 fds
                                   (zygote only; no answer: the new context says ready on its
                                   socket; rewarm: it reruns the warm-up code first)
  {"op": "ack"}                                            (a display was relayed)
Driver -> agent:
  {"ev": "ready", "pid": int, "cwd": str}
  {"ev": "result", "data": {mime: value}, "metadata": {...}, "execution_count": int}
  {"ev": "display", "data": {mime: value}, "metadata": {...}}   (then waits for the ack)
  {"ev": "exception", "name": str, "value": str, "traceback": [str]}
  {"ev": "end", "status": "ok" | "error" | "interrupted", "execution_count": int}
  {"ev": "error", "message": str}                          (a setup request failed)

Syscalls per cell are kept few (guest syscalls cost milliseconds on kvm_pvm): one recv for the
request, the writes the code itself makes, and one send carrying the closing events (result,
exception, end) together. A display() is sent when it happens (after flushing stdout/stderr,
so that the agent, which drains the pipes before relaying a control event, keeps the order).
No threads, no timers, no polling.

Only the standard library and IPython are used.
"""

import base64
import gc
import json
import os
import signal
import socket
import struct
import sys

# Before anything can import matplotlib: every figure open at the end of a cell is displayed as
# image/png and closed, without plt.show().
os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
if not os.environ.get("IPYTHONDIR"):
    os.environ["IPYTHONDIR"] = "/tmp/ember-ipython"

HEADER = struct.Struct("<I")
MAX_FRAME = 16 * 1024 * 1024
RECV_SIZE = 1 << 20


class Channel:
    """Framed JSON messages over a stream socket."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()
        # Received into a buffer allocated once: a fresh 1 MiB bytes object per recv would cost
        # an mmap, an mremap and a munmap per cell.
        self.rbuf = bytearray(RECV_SIZE)
        self.rview = memoryview(self.rbuf)

    def _frame(self):
        if len(self.buf) < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self.buf)
        if length > MAX_FRAME:
            raise ValueError("frame of %d bytes from the agent" % length)
        if len(self.buf) < HEADER.size + length:
            return None
        body = bytes(self.buf[HEADER.size : HEADER.size + length])
        del self.buf[: HEADER.size + length]
        return json.loads(body)

    def recv(self, with_fds=0):
        """The next message (and any descriptors that came with it); None at EOF."""
        fds = []
        while True:
            msg = self._frame()
            if msg is not None:
                return msg, fds
            if with_fds:
                data, got, _flags, _addr = socket.recv_fds(self.sock, RECV_SIZE, with_fds)
                fds.extend(got)
            else:
                n = self.sock.recv_into(self.rbuf)
                data = self.rview[:n]
            if not data:
                for fd in fds:
                    os.close(fd)
                return None, []
            self.buf += data

    def wait_ack(self):
        """Blocks until the agent acknowledges the last display (a SIGINT still interrupts)."""
        while True:
            msg, _ = self.recv()
            if msg is None or msg.get("op") == "ack":
                return

    def send(self, *messages):
        """Sends messages in one write, after flushing the output streams."""
        flush_stdio()
        out = bytearray()
        for msg in messages:
            body = json.dumps(msg, default=str).encode()
            out += HEADER.pack(len(body))
            out += body
        self.sock.sendall(out)


def flush_stdio():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def jsonable_bundle(data):
    """A MIME bundle as JSON: bytes (png, jpeg) as base64 strings, JSON types as they are."""
    out = {}
    for mime, value in (data or {}).items():
        if isinstance(value, (bytes, bytearray, memoryview)):
            out[mime] = base64.b64encode(bytes(value)).decode("ascii")
        elif isinstance(value, str) and mime.startswith("image/") and not mime.startswith("image/svg"):
            # IPython hands PNG/JPEG over already base64-encoded, with line breaks.
            out[mime] = "".join(value.split())
        elif isinstance(value, (str, int, float, bool, list, dict)) or value is None:
            out[mime] = value
        else:
            out[mime] = str(value)
    return out


class State:
    """What the current cell produced; the shell's hooks write here."""

    def __init__(self):
        self.channel = None
        self.running = False
        self.pending = []
        self.exception = None
        self.frozen = False
        self.warm_code = None


STATE = State()


def on_sigint(_signum, _frame):
    # Idle (waiting for the next request, or sending the closing events): ignored. The agent
    # only interrupts running code; a late signal must not kill the context.
    if STATE.running:
        raise KeyboardInterrupt


def build_shell():
    from traitlets.config import Config
    from IPython.core.displayhook import DisplayHook
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell

    class EmberDisplayHook(DisplayHook):
        """The value of a cell's last expression becomes a `result` event."""

        def start_displayhook(self):
            pass

        def write_output_prompt(self):
            pass

        def write_format_data(self, format_dict, md_dict=None):
            STATE.pending.append(
                {
                    "ev": "result",
                    "data": jsonable_bundle(format_dict),
                    "metadata": md_dict or {},
                    "execution_count": self.shell.execution_count,
                }
            )

        def finish_displayhook(self):
            pass

    class EmberDisplayPublisher(DisplayPublisher):
        """display(...) becomes a `display` event, sent at once (streams stay in order)."""

        def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kw):
            STATE.pending.append(
                {"ev": "display", "data": jsonable_bundle(data), "metadata": metadata or {}}
            )
            if STATE.channel is not None:
                pending, STATE.pending = STATE.pending, []
                STATE.channel.send(*pending)
                if STATE.running:
                    # Wait for the agent's ack: it relays the display after the output written
                    # before it and before any written after it (two syscalls per display).
                    STATE.channel.wait_ack()

        def clear_output(self, wait=False):
            pass

    class EmberShell(InteractiveShell):
        def _showtraceback(self, etype, evalue, stb):
            STATE.exception = {
                "ev": "exception",
                "name": getattr(etype, "__name__", str(etype)),
                "value": str(evalue),
                "traceback": list(stb) if not isinstance(stb, str) else [stb],
            }

    config = Config()
    config.HistoryManager.enabled = False
    config.InteractiveShell.colors = "NoColor"
    config.InteractiveShell.xmode = "Plain"
    shell = EmberShell.instance(
        config=config,
        displayhook_class=EmberDisplayHook,
        display_pub_class=EmberDisplayPublisher,
    )
    # `!cmd` through a plain shell (no pty), output straight to fd 1/2.
    shell.system = shell.system_raw
    shell.colors = "NoColor"
    return shell


def apply_env(env):
    """Sets `env`; returns what undoes it."""
    saved = {}
    for key, value in (env or {}).items():
        saved[key] = os.environ.get(key)
        os.environ[key] = str(value)
    return saved


def restore_env(saved):
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def reseed():
    """Fresh RNG state after a snapshot restore (the kernel's CRNG was reseeded by the host's
    ``sync``): every clone of a template would otherwise draw the same ``random`` numbers."""
    import random

    # 256 bits from the kernel, expanded in user space: `random.seed()` alone reads 2,496
    # bytes of getrandom(), which the guest kernel generates (ChaCha20) in emulated ring-0
    # instructions on kvm_pvm — tens of thousands of them on a clone's first cell.
    seed = os.urandom(64)
    random.seed(int.from_bytes(seed[:32], "little"))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            numpy.random.seed([int.from_bytes(seed[i:i + 4], "little") for i in range(32, 64, 4)])
        except Exception:  # noqa: BLE001 - a broken numpy must not break the cell
            pass


UNDERS = ("_", "__", "___")
ABSENT = object()


def save_unders(shell):
    """What a cell's result changes (``_``, ``__``, ``___`` in the namespace and the display
    hook, ``_<n>`` and ``Out[n]`` for the current count n), to be put back after a silent
    cell."""
    hook = shell.displayhook
    ns = shell.user_ns
    count = shell.execution_count
    numbered = "_%d" % count
    out = ns.get("_oh")
    return (
        count,
        {k: getattr(hook, k, ABSENT) for k in UNDERS},
        {k: ns.get(k, ABSENT) for k in UNDERS + (numbered,)},
        out.get(count, ABSENT) if isinstance(out, dict) else ABSENT,
    )


def restore_unders(shell, saved):
    count, hook_values, ns_values, out_value = saved
    hook = shell.displayhook
    ns = shell.user_ns
    for k, v in hook_values.items():
        if v is not ABSENT:
            setattr(hook, k, v)
    for k, v in ns_values.items():
        if v is ABSENT:
            ns.pop(k, None)
        else:
            ns[k] = v
    out = ns.get("_oh")
    if isinstance(out, dict):
        if out_value is ABSENT:
            out.pop(count, None)
        else:
            out[count] = out_value


def run(shell, channel, msg):
    if msg.get("reseed"):
        reseed()
    STATE.pending = []
    STATE.exception = None
    status = "ok"
    saved = {}
    # A silent cell (the warm pool's priming cell) leaves no trace: not stored (the execution
    # count does not advance), its result not in `_` or `Out`.
    silent = bool(msg.get("silent"))
    unders = save_unders(shell) if silent else None
    try:
        saved = apply_env(msg.get("env"))
        STATE.running = True
        try:
            result = shell.run_cell(msg.get("code", ""), store_history=not silent)
        finally:
            STATE.running = False
        error = result.error_before_exec or result.error_in_exec
        if isinstance(error, KeyboardInterrupt):
            status = "interrupted"
        elif error is not None or STATE.exception is not None:
            status = "error"
        if error is not None and STATE.exception is None:
            STATE.exception = {
                "ev": "exception",
                "name": type(error).__name__,
                "value": str(error),
                "traceback": [],
            }
    except KeyboardInterrupt as e:
        # Arrived outside the user's code (in IPython's own machinery).
        STATE.running = False
        status = "interrupted"
        STATE.exception = {"ev": "exception", "name": "KeyboardInterrupt", "value": str(e), "traceback": []}
    finally:
        restore_env(saved)
        if unders is not None:
            restore_unders(shell, unders)
    closing = STATE.pending
    STATE.pending = []
    if STATE.exception is not None:
        closing.append(STATE.exception)
        STATE.exception = None
    count = shell.execution_count - 1
    closing.append({"ev": "end", "status": status, "execution_count": count})
    channel.send(*closing)
    if getattr(shell, "exit_now", False):
        # `exit()` / `quit()`: the context ends; the agent restarts it on the next call.
        flush_stdio()
        os._exit(0)


def setup(msg):
    """Applies a context's cwd and environment (a spare being handed out)."""
    for key, value in (msg.get("env") or {}).items():
        os.environ[key] = str(value)
    cwd = msg.get("cwd")
    if cwd:
        os.chdir(cwd)


def ready(channel):
    channel.send({"ev": "ready", "pid": os.getpid(), "cwd": os.getcwd()})


def serve(shell, channel, zygote=False):
    STATE.channel = channel
    while True:
        try:
            msg, fds = channel.recv(with_fds=3 if zygote else 0)
        except KeyboardInterrupt:
            continue
        if msg is None:
            return
        op = msg.get("op")
        if op == "run":
            if zygote:
                # The zygote only ever runs the template's warm-up; contexts forked at build
                # time run it again (see warm_context).
                STATE.warm_code = msg.get("code") or None
            run(shell, channel, msg)
        elif op == "setup":
            try:
                setup(msg)
            except OSError as e:
                channel.send({"ev": "error", "message": "%s: %s" % (msg.get("cwd"), e)})
                continue
            ready(channel)
        elif op == "fork" and zygote:
            fork_context(shell, channel, msg, fds)
        else:
            for fd in fds:
                os.close(fd)
            channel.send({"ev": "error", "message": "unknown op %r" % (op,)})


def warm_tracebacks(shell):
    """Formats one traceback in the zygote, so that contexts forked from it find IPython's
    traceback machinery loaded on their first error (a timeout's KeyboardInterrupt included)
    instead of paying for it then."""
    try:
        shell.run_cell(
            "def __ember_warm():\n    raise ValueError('warm-up')\n__ember_warm()",
            store_history=False,
        )
    except BaseException:  # noqa: B036 - nothing of this may escape into the zygote's loop
        pass
    finally:
        shell.user_ns.pop("__ember_warm", None)
        STATE.pending = []
        STATE.exception = None


def warm_context(shell, code=None):
    """Runs a cell with a result, one that raises and, when given, the template's warm-up
    code again, silently (output to /dev/null, nothing sent): the first cells of a forked
    context copy (copy-on-write) the pages of everything they touch, which costs seconds of
    guest page faults on kvm_pvm; done here, it happens before the context is handed out —
    at template build time for the contexts in the snapshot."""
    flush_stdio()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        for cell in ("0", code):
            if cell:
                try:
                    shell.run_cell(cell, store_history=False)
                except BaseException:  # noqa: B036 - nothing of this may escape
                    pass
                STATE.pending = []
                STATE.exception = None
        warm_tracebacks(shell)
    finally:
        flush_stdio()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved + [devnull]:
            os.close(fd)


def fork_context(shell, zygote_channel, msg, fds):
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return
    ctl_fd, out_fd, err_fd = fds
    flush_stdio()
    if not STATE.frozen:
        warm_tracebacks(shell)
        # Everything the warm-up built moves to the GC's permanent generation: contexts forked
        # from here never walk (and so never touch or copy) those pages in a collection. In a
        # restored clone each first touch of a page is expensive, and a full collection over
        # IPython's and the warm-up's objects cost seconds there.
        gc.collect()
        gc.freeze()
        STATE.frozen = True
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        os.waitpid(pid, 0)
        return
    # The intermediate child: fork again and leave, so that the context is re-parented.
    try:
        if os.fork():
            os._exit(0)
        os.setsid()
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        zygote_channel.sock.close()
        STATE.channel = None
        setup(msg)
        shell.execution_count = 1
        warm_context(shell, STATE.warm_code if msg.get("rewarm") else None)
        channel = Channel(socket.socket(fileno=ctl_fd))
        ready(channel)
        serve(shell, channel)
    except BaseException:  # noqa: B036 - whatever happens, this process must not return
        os._exit(1)
    flush_stdio()
    os._exit(0)


def main(argv):
    zygote = "--zygote" in argv
    fd = 3
    if "--fd" in argv:
        fd = int(argv[argv.index("--fd") + 1])
    signal.signal(signal.SIGINT, on_sigint)
    try:
        sys.stdout.reconfigure(line_buffering=True)
    except (AttributeError, ValueError):
        pass
    channel = Channel(socket.socket(fileno=fd))
    shell = build_shell()
    ready(channel)
    serve(shell, channel, zygote=zygote)
    flush_stdio()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])

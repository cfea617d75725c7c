// ember's Java context driver: a jshell (the JDK's jdk.jshell API) whose snippets run in this
// JVM. Embedded in ember-agent and written to /run/ember/drivers when a Java context first
// starts; run as `java EmberJShell.java` (the JDK's source launcher).
//
// Descriptors (see "Code contexts" in agent/PROTOCOL.md): fd 0 is the agent's socket, on which
// requests arrive (one frame each: u32 LE length + fields `NAME LEN\n` + LEN bytes + `\n`; op =
// run | setup | ack; code; cwd; reseed; env.KEY); fd 3 a pipe on which events go back as framed
// JSON, the Python driver's events (ready, result, exception, end, error); fd 1/2 are pipes the
// agent reads (System.out and System.err). A cell is split into snippets by jshell's own
// completeness analysis and each evaluated in turn: declarations and imports stay for later
// cells, the value of a last expression is the result, an exception (or a snippet that does not
// compile) ends the cell as an error. SIGINT stops the running snippet.

import java.io.ByteArrayOutputStream;
import java.io.DataInputStream;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.io.PrintStream;
import java.lang.reflect.Field;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.stream.Collectors;

import jdk.jshell.Diag;
import jdk.jshell.EvalException;
import jdk.jshell.JShell;
import jdk.jshell.JShellException;
import jdk.jshell.Snippet;
import jdk.jshell.SnippetEvent;
import jdk.jshell.SourceCodeAnalysis;
import jdk.jshell.UnresolvedReferenceException;
import jdk.jshell.execution.LocalExecutionControlProvider;

public class EmberJShell {
    static final InputStream REQUESTS = System.in;
    static OutputStream events;
    static JShell shell;
    static volatile boolean interrupted;
    static volatile boolean running;
    static volatile int count;
    /** Guards `running`, `interrupted` and `count` against the SIGINT handler's stopper. */
    static final Object LOCK = new Object();
    /** How often a stop is repeated while the interrupted cell has not ended. */
    static final long STOP_AGAIN_MS = 50;

    public static void main(String[] args) throws Exception {
        events = new FileOutputStream("/dev/fd/3");
        shell = JShell.builder()
                .executionEngine(new LocalExecutionControlProvider(), new HashMap<>())
                .out(System.out)
                .err(System.err)
                .build();
        sun.misc.Signal.handle(new sun.misc.Signal("INT"), sig -> interrupt());
        warm();
        ready();
        DataInputStream in = new DataInputStream(REQUESTS);
        while (true) {
            Map<String, String> msg = next(in);
            if (msg == null) {
                System.exit(0);
            }
            String op = msg.getOrDefault("op", "");
            if (op.equals("run")) {
                if ("1".equals(msg.get("reseed"))) {
                    reseed();
                }
                run(msg.getOrDefault("code", ""));
            } else if (op.equals("setup")) {
                // The JVM cannot change its working directory or environment: only user.dir.
                String cwd = msg.get("cwd");
                if (cwd != null && !cwd.isEmpty()) {
                    if (!new java.io.File(cwd).isDirectory()) {
                        send(List.of("{\"ev\":\"error\",\"message\":" + str(cwd + ": no such directory") + "}"));
                        continue;
                    }
                    System.setProperty("user.dir", cwd);
                }
                ready();
            } else if (!op.equals("ack")) {
                send(List.of("{\"ev\":\"error\",\"message\":" + str("unknown op " + op) + "}"));
            }
        }
    }

    /**
     * SIGINT: stops the cell under way. `JShell.stop()` stops only an execution already running,
     * so one made while jshell still compiles the snippet (seconds on a slow guest) would be
     * lost: a thread repeats it until this cell ends. The lock keeps a stop from reaching the
     * next cell.
     */
    static void interrupt() {
        final int cell;
        synchronized (LOCK) {
            if (!running || interrupted) {
                return;
            }
            interrupted = true;
            cell = count;
        }
        Thread stopper = new Thread(() -> {
            while (true) {
                synchronized (LOCK) {
                    if (!running || count != cell) {
                        return;
                    }
                    shell.stop();
                }
                try {
                    Thread.sleep(STOP_AGAIN_MS);
                } catch (InterruptedException e) {
                    return;
                }
            }
        }, "ember-interrupt");
        stopper.setDaemon(true);
        stopper.start();
    }

    static void ready() throws IOException {
        long pid = ProcessHandle.current().pid();
        send(List.of("{\"ev\":\"ready\",\"pid\":" + pid + ",\"cwd\":" + str(System.getProperty("user.dir")) + "}"));
    }

    /** One of each kind of snippet before `ready`, so that a first cell finds javac warm. */
    static void warm() {
        String[] cells = {
            "int emberWarm(int x) { return x + 1; }",
            "var emberWarmList = new java.util.ArrayList<String>(java.util.List.of(\"a\"));",
            "emberWarm(41) + emberWarmList.size()",
            "System.out.print(\"\");",
            "Math.random() + java.util.concurrent.ThreadLocalRandom.current().nextInt()",
            "Integer.parseInt(\"x\")",
        };
        List<Snippet> made = new ArrayList<>();
        for (String cell : cells) {
            for (SnippetEvent e : shell.eval(cell)) {
                if (e.snippet() != null) {
                    made.add(e.snippet());
                }
            }
        }
        for (Snippet s : made) {
            shell.drop(s);
        }
        count = 0;
        // A collection now leaves the heap compact and the next one far off: after a restore,
        // every page a collection walks costs a fault (milliseconds each where guest memory
        // faults are emulated).
        System.gc();
    }

    /**
     * Fresh seeds for the JDK's shared generators after a snapshot restore (every clone would
     * otherwise draw what the others draw): Math.random()'s generator, the seeds of later
     * `new Random()`s, ThreadLocalRandom's and SplittableRandom's seed sources, all from the
     * kernel's pool, which the host reseeded. Needs `--add-opens` for java.lang, java.util and
     * java.util.concurrent (given by the agent). SecureRandom reads the kernel's pool itself.
     */
    static void reseed() {
        byte[] bytes = new byte[32];
        try (InputStream in = new java.io.FileInputStream("/dev/urandom")) {
            if (in.readNBytes(bytes, 0, bytes.length) != bytes.length) {
                return;
            }
        } catch (IOException e) {
            System.err.println("ember: reseeding: " + e);
            return;
        }
        java.nio.LongBuffer seeds = java.nio.ByteBuffer.wrap(bytes).asLongBuffer();
        try {
            Field math = Class.forName("java.lang.Math$RandomNumberGeneratorHolder")
                    .getDeclaredField("randomNumberGenerator");
            math.setAccessible(true);
            ((java.util.Random) math.get(null)).setSeed(seeds.get(0));
            String[][] sources = {
                {"java.util.Random", "seedUniquifier"},
                {"java.util.concurrent.ThreadLocalRandom", "seeder"},
                {"java.util.SplittableRandom", "defaultGen"},
            };
            for (int i = 0; i < sources.length; i++) {
                Field f = Class.forName(sources[i][0]).getDeclaredField(sources[i][1]);
                f.setAccessible(true);
                ((java.util.concurrent.atomic.AtomicLong) f.get(null)).set(seeds.get(i + 1));
            }
        } catch (ReflectiveOperationException | RuntimeException e) {
            System.err.println("ember: reseeding: " + e);
        }
    }

    static void run(String code) throws IOException {
        synchronized (LOCK) {
            count++;
            interrupted = false;
            running = true;
        }
        List<String> closing = new ArrayList<>();
        String status = "ok";
        String result = null;
        SourceCodeAnalysis analysis = shell.sourceCodeAnalysis();
        String remaining = code;
        try {
            while (!remaining.isBlank()) {
                if (interrupted) {
                    // Interrupted between snippets: the rest of the cell does not run.
                    closing.add(exception("KeyboardInterrupt", "interrupted", List.of()));
                    status = "interrupted";
                    result = null;
                    break;
                }
                SourceCodeAnalysis.CompletionInfo info = analysis.analyzeCompletion(remaining);
                String source = info.source();
                if (source == null || info.completeness() == SourceCodeAnalysis.Completeness.DEFINITELY_INCOMPLETE
                        || info.completeness() == SourceCodeAnalysis.Completeness.CONSIDERED_INCOMPLETE) {
                    // Incomplete at the end of the cell: let jshell report what is wrong.
                    source = remaining;
                    remaining = "";
                } else {
                    remaining = info.remaining();
                }
                if (source.isBlank()) {
                    continue;
                }
                result = null;
                String error = null;
                final String snippet = source;
                for (SnippetEvent e : shell.eval(source)) {
                    if (e.causeSnippet() != null) {
                        continue;
                    }
                    JShellException ex = e.exception();
                    if (interrupted) {
                        error = exception("KeyboardInterrupt", "interrupted", List.of());
                        status = "interrupted";
                    } else if (ex != null) {
                        error = thrown(ex);
                        status = "error";
                    } else if (e.status() == Snippet.Status.REJECTED) {
                        List<String> lines = shell.diagnostics(e.snippet())
                                .map(d -> diag(snippet, d))
                                .collect(Collectors.toList());
                        String first = lines.isEmpty() ? "the snippet does not compile" : lines.get(0);
                        error = exception("CompilationError", first, lines);
                        status = "error";
                    } else if (e.value() != null && isExpression(e.snippet())) {
                        result = e.value();
                    }
                }
                if (error != null) {
                    closing.add(error);
                    result = null;
                    break;
                }
            }
        } catch (RuntimeException e) {
            closing.add(thrown(e));
            status = interrupted ? "interrupted" : "error";
        } finally {
            synchronized (LOCK) {
                running = false;
            }
        }
        if (result != null) {
            closing.add(0, "{\"ev\":\"result\",\"data\":{\"text/plain\":" + str(result) + "},\"execution_count\":" + count + "}");
        }
        closing.add("{\"ev\":\"end\",\"status\":\"" + status + "\",\"execution_count\":" + count + "}");
        send(closing);
    }

    static boolean isExpression(Snippet s) {
        switch (s.subKind()) {
            case TEMP_VAR_EXPRESSION_SUBKIND:
            case VAR_VALUE_SUBKIND:
            case ASSIGNMENT_SUBKIND:
            case OTHER_EXPRESSION_SUBKIND:
                return true;
            default:
                return false;
        }
    }

    static String diag(String source, Diag d) {
        String msg = d.getMessage(null);
        long pos = d.getPosition();
        if (pos >= 0 && pos <= source.length()) {
            int line = 1;
            for (int i = 0; i < pos; i++) {
                if (source.charAt(i) == '\n') {
                    line++;
                }
            }
            return "line " + line + ": " + msg;
        }
        return msg;
    }

    static String thrown(Throwable t) {
        String name;
        if (t instanceof EvalException) {
            name = ((EvalException) t).getExceptionClassName();
        } else if (t instanceof UnresolvedReferenceException) {
            name = "UnresolvedReferenceException";
        } else {
            name = t.getClass().getName();
        }
        String message = t.getMessage() == null ? "" : t.getMessage();
        List<String> trace = new ArrayList<>();
        trace.add(name + (message.isEmpty() ? "" : ": " + message));
        for (StackTraceElement el : t.getStackTrace()) {
            trace.add("\tat " + el);
        }
        Throwable cause = t.getCause();
        while (cause != null) {
            String cn = cause instanceof EvalException ? ((EvalException) cause).getExceptionClassName() : cause.getClass().getName();
            trace.add("Caused by: " + cn + (cause.getMessage() == null ? "" : ": " + cause.getMessage()));
            for (StackTraceElement el : cause.getStackTrace()) {
                trace.add("\tat " + el);
            }
            cause = cause.getCause();
        }
        return exception(name, message, trace);
    }

    static String exception(String name, String value, List<String> traceback) {
        return "{\"ev\":\"exception\",\"name\":" + str(name) + ",\"value\":" + str(value) + ",\"traceback\":["
                + traceback.stream().map(EmberJShell::str).collect(Collectors.joining(",")) + "]}";
    }

    static String str(String s) {
        StringBuilder b = new StringBuilder(s.length() + 2).append('"');
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            switch (c) {
                case '"': b.append("\\\""); break;
                case '\\': b.append("\\\\"); break;
                case '\n': b.append("\\n"); break;
                case '\r': b.append("\\r"); break;
                case '\t': b.append("\\t"); break;
                default:
                    if (c < 0x20) {
                        b.append(String.format("\\u%04x", (int) c));
                    } else {
                        b.append(c);
                    }
            }
        }
        return b.append('"').toString();
    }

    static void send(List<String> messages) throws IOException {
        System.out.flush();
        System.err.flush();
        ByteArrayOutputStream out = new ByteArrayOutputStream();
        for (String m : messages) {
            byte[] body = m.getBytes(StandardCharsets.UTF_8);
            int n = body.length;
            out.write(n & 0xff);
            out.write((n >>> 8) & 0xff);
            out.write((n >>> 16) & 0xff);
            out.write((n >>> 24) & 0xff);
            out.write(body);
        }
        events.write(out.toByteArray());
        events.flush();
    }

    static Map<String, String> next(DataInputStream in) throws IOException {
        byte[] head = new byte[4];
        try {
            in.readFully(head);
        } catch (java.io.EOFException e) {
            return null;
        }
        int n = (head[0] & 0xff) | (head[1] & 0xff) << 8 | (head[2] & 0xff) << 16 | (head[3] & 0xff) << 24;
        byte[] body = new byte[n];
        in.readFully(body);
        Map<String, String> msg = new HashMap<>();
        int i = 0;
        while (i < n) {
            int nl = i;
            while (nl < n && body[nl] != '\n') {
                nl++;
            }
            String[] parts = new String(body, i, nl - i, StandardCharsets.UTF_8).split(" ");
            int len = Integer.parseInt(parts[1]);
            msg.put(parts[0], new String(body, nl + 1, len, StandardCharsets.UTF_8));
            i = nl + len + 2;
        }
        return msg;
    }
}

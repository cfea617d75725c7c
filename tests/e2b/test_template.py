"""The E2B Python SDK's template build API against ember (driven by tests/e2b.rs).

Env: E2B_API_KEY, E2B_API_URL = E2B_SANDBOX_URL = the server. Builds two templates with the
unchanged SDK — one with the `Template()` builder (`from_template("base")`, `set_envs`,
`copy` of a directory, `set_workdir`, `run_cmd`, `set_user`), one with `from_dockerfile` —
polls their builds to the end (`Template.build`), then `Sandbox.create(name)` of each runs
code and commands that see what the steps did. Prints one JSON line for the Rust side to
check.
"""

import atexit
import json
import os
import shutil
import sys
import tempfile
import time

from e2b import Template
from e2b_code_interpreter import Sandbox

ctx = tempfile.mkdtemp(prefix="ember-e2b-template-")
atexit.register(shutil.rmtree, ctx, True)
os.makedirs(os.path.join(ctx, "app"))
with open(os.path.join(ctx, "app", "hello.txt"), "w") as f:
    f.write("hello from the context\n")
with open(os.path.join(ctx, "app", "skip.log"), "w") as f:
    f.write("ignored\n")
with open(os.path.join(ctx, ".dockerignore"), "w") as f:
    f.write("**/*.log\n")

logs = []


def on_log(entry):
    logs.append(str(entry))
    print(entry, file=sys.stderr, flush=True)


out = {}
t0 = time.time()
builder = (
    Template(file_context_path=ctx)
    .from_template("base")
    .set_envs({"EMBER_T": "from-sdk"})
    .copy("app", "/srv/app/")
    .set_workdir("/srv/app")
    .run_cmd("echo built-by-run > /srv/app/built.txt")
    .set_user("user")
)
info = Template.build(builder, "e2b-sdk-tpl", on_build_logs=on_log)
out["builder_seconds"] = round(time.time() - t0, 1)
out["builder_name"] = info.name

dockerfile = """FROM template:base
ENV EMBER_D=from-dockerfile
WORKDIR /opt/df
COPY app/hello.txt ./
RUN echo from-run > /opt/df/run.txt
"""
t0 = time.time()
df = Template(file_context_path=ctx).from_dockerfile(dockerfile)
Template.build(df, "e2b-df-tpl:v1", on_build_logs=on_log)
out["dockerfile_seconds"] = round(time.time() - t0, 1)

for name, script, code in [
    (
        "e2b-sdk-tpl",
        "cat /srv/app/hello.txt /srv/app/built.txt; ls /srv/app; echo $EMBER_T; whoami",
        "import os; print(os.environ.get('EMBER_T'), open('/srv/app/built.txt').read().strip())",
    ),
    (
        "e2b-df-tpl",
        "cat /opt/df/hello.txt /opt/df/run.txt; echo $EMBER_D",
        "print(6 * 7)",
    ),
]:
    t0 = time.time()
    sbx = Sandbox.create(name, timeout=300)
    try:
        r = sbx.commands.run(script, timeout=120)
        ex = sbx.run_code(code)
        out[name] = {
            "stdout": r.stdout,
            "code": "".join(ex.logs.stdout).strip(),
            "error": None if ex.error is None else f"{ex.error.name}: {ex.error.value}",
            "create_to_result_ms": round((time.time() - t0) * 1000),
        }
    finally:
        sbx.kill()

out["exists"] = [Template.exists("e2b-sdk-tpl"), Template.exists("e2b-no-such-tpl")]
out["tags"] = sorted(t.tag for t in Template.get_tags("e2b-df-tpl"))
out["log_lines"] = len(logs)
print(json.dumps(out))

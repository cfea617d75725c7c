#!/usr/bin/env python3
"""Checks deploy/ offline, without a cluster, kubectl, nomad or a booted systemd.

Run it with the venv of scripts/deploy-validators.sh:
    $EMBER_DEPLOY_PY scripts/validate-deploy.py [--deploy DIR] [--ember BIN]

- Kubernetes: renders deploy/kubernetes/base and every overlay the way kustomize would (only
  what the manifests use: resources, namespace, labels, images), then validates every object
  with kubernetes-validate's strict schemas (an unknown field or a wrong type is refused) for
  each version in K8S_VERSIONS, plus the Secret template; then what the schemas cannot see:
  the node's host access, probes, drain and grace period, the gateway's probes and replicas,
  and that every key of `ember-secrets` a manifest reads is in the template.
- Nomad: parses the job files with python-hcl2 and checks job types, the node's constraint,
  driver and kill_timeout (long enough for a drain), the health checks and their ports.
- systemd: `systemd-analyze verify` on copies of the units whose `ember` path points at a stub
  (verify refuses a unit whose binary is missing, and ember is installed only on real hosts),
  with any warning about a unit counted as a failure (verify exits 0 on an unknown
  directive); then KillMode, Restart, TimeoutStopSec, the drain and the gateway's hardening.
- ember itself: every command line the manifests run is checked against `ember ... --help` of
  a built binary (--ember, $EMBER_BIN, else ${CARGO_TARGET_DIR:-target}/debug/ember): each
  flag and EMBER_* variable exists, each required option is given. `cluster drain` and
  `--blobs` / EMBER_BLOBS are accepted with a warning while the binary does not have them yet.
  Without a binary these checks are skipped, with a warning.

Prints one line per check; exits 1 if any failed, each failure naming its file and reason.
"""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import hcl2
import kubernetes_validate
import yaml
from hcl2.utils import SerializationOptions

# The oldest Kubernetes these manifests are meant for, and the newest the pinned schemas know.
K8S_VERSIONS = ("1.30", "1.37")
# A drain pauses and uploads every sandbox of a node: the least time any engine may allow.
MIN_STOP_SECS = 60
NODE_HEALTH = "/internal/v1/health"
NODE_LIVE = "/internal/v1/live"
GATEWAY_HEALTH = "/healthz"
# The capabilities `ember node` needs when not privileged.
NODE_CAPS = {
    "SYS_ADMIN", "NET_ADMIN", "SYS_RESOURCE", "SETUID", "SETGID", "CHOWN", "DAC_OVERRIDE",
    "MKNOD", "SYS_CHROOT", "KILL",
}
NODE_DEVICES = ("/dev/kvm", "/dev/net/tun", "/dev/vhost-vsock")
# Read by the runtime itself rather than by a flag.
RUNTIME_ENV = {"EMBER_HOME", "EMBER_CACHE", "EMBER_VMM", "EMBER_JAILER"}
# Being added (blobs in S3, drain): accepted, with a warning, while a binary lacks them.
UPCOMING_FLAGS = {("node", "--blobs")}
UPCOMING_ENV = {("node", "EMBER_BLOBS")}
UPCOMING_COMMANDS = {("cluster", "drain")}
SECRET_NAME = "ember-secrets"
# Keys of the Secret template that must hold a placeholder, never a value.
SECRET_PLACEHOLDER_KEYS = ("db-url", "node-token", "client-token", "aws-access-key-id",
                           "aws-secret-access-key")
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                  "StorageClass", "PriorityClass", "CustomResourceDefinition"}
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"}


class Report:
    """Prints each check's outcome and counts the failures."""

    def __init__(self):
        self.passed = 0
        self.failed = 0

    def ok(self, where, what):
        self.passed += 1
        print(f"ok    {where}: {what}")

    def fail(self, where, why):
        self.failed += 1
        print(f"FAIL  {where}: {why}")

    def warn(self, where, what):
        print(f"warn  {where}: {what}")

    def check(self, cond, where, what, why):
        """ok(what) if cond, else fail(why); returns cond."""
        if cond:
            self.ok(where, what)
        else:
            self.fail(where, why)
        return cond


R = Report()


def rel(path, root):
    try:
        return str(Path(path).relative_to(root.parent))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------------------
# ember command lines: finding them in argv lists and shell scripts, checking them


SHELLS = {"sh", "bash", "dash"}
SHELL_WORDS = {"exec", "if", "then", "else", "elif", "do", "while", "until", "!", "{", "("}


def ember_calls(argv):
    """The ember command lines (arguments after `ember`) run by argv: argv itself, ember
    after a wrapper (`nsenter ... -- ember ...`), or those of a `sh -c SCRIPT`."""
    if not argv:
        return []
    if os.path.basename(argv[0]) in SHELLS and "-c" in argv[:-1]:
        return script_calls(argv[argv.index("-c") + 1])
    for i, word in enumerate(argv):
        if os.path.basename(word) == "ember":
            return [argv[i + 1:]]
    return []


def script_calls(script):
    """The ember command lines of a POSIX shell script (and of the scripts its traps run)."""
    lex = shlex.shlex(script.replace("\\\n", " "), posix=True, punctuation_chars=";&|\n")
    lex.whitespace = " \t\r"
    lex.whitespace_split = True
    tokens = list(lex)
    calls, cmd = [], []
    for tok in tokens + [";"]:
        if tok and set(tok) <= set(";&|\n"):
            while cmd and (cmd[0] in SHELL_WORDS or re.match(r"^[A-Za-z_]\w*=", cmd[0])):
                cmd.pop(0)
            if cmd and cmd[0] == "trap" and len(cmd) > 1:
                calls += script_calls(cmd[1])
            else:
                calls += ember_calls(cmd)
            cmd = []
        else:
            cmd.append(tok)
    return calls


def command_path(args):
    """(command path, the rest): `node ...` → (("node",), ...); `cluster drain ...` →
    (("cluster", "drain"), ...)."""
    path = []
    while args and not args[0].startswith("-") and (not path or path == ["cluster"]):
        path.append(args[0])
        args = args[1:]
    return tuple(path), args


def flags_of(args):
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def flag_value(args, flag):
    """The value given to `flag` (`--flag=V` or `--flag V`), or None."""
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return None


class EmberCli:
    """What a built `ember` says about its commands (`--help`), remembered per command."""

    def __init__(self, binary):
        self.binary = binary
        self.helps = {}

    def help(self, path):
        """(flags, {flag: env}, required flags, subcommands) of `ember PATH`, or None if it
        has no such command."""
        if path in self.helps:
            return self.helps[path]
        # A clean environment: clap shows an [env: NAME=value] it finds set.
        out = subprocess.run([str(self.binary), *path, "--help"], capture_output=True,
                             text=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        result = None
        if out.returncode == 0:
            flags, envs, subs, current, section = set(), {}, set(), None, None
            required = set()
            for line in out.stdout.splitlines():
                if line.startswith("Usage:"):
                    usage = line.split("[OPTIONS]", 1)[-1]
                    required = set(re.findall(r"(?<![\[\w-])(--[a-z0-9-]+)", usage))
                if re.match(r"^[A-Z][a-z]+:$", line):
                    section = line[:-1]
                    continue
                m = re.match(r"^\s+(?:-\w, )?(--[a-z0-9][a-z0-9-]*)", line)
                if m and section == "Options":
                    current = m.group(1)
                    flags.add(current)
                m = re.match(r"^  ([a-z][a-z0-9-]*)\s", line)
                if m and section == "Commands":
                    subs.add(m.group(1))
                for env in re.findall(r"\[env: ([A-Z0-9_]+)=", line):
                    if current:
                        envs[current] = env
            result = (flags, envs, required, subs)
        self.helps[path] = result
        return result

    def check_call(self, where, args, env_names=()):
        """Checks one command line (`args` after `ember`) and, for node and gateway, the
        EMBER_* variables `env_names` it is given."""
        path, rest = command_path(args)
        shown = "ember " + " ".join(path)
        if len(path) == 2 and path[:1] and self.help(path[:1]):
            subs = self.help(path[:1])[3]
            if path[1] not in subs:
                if path in UPCOMING_COMMANDS:
                    R.warn(where, f"`{shown}` is not in this ember's help yet; accepted as "
                                  "known-upcoming")
                    return
                R.fail(where, f"`{shown}`: ember has no such command "
                              f"(`ember {path[0]}` has: {', '.join(sorted(subs))})")
                return
        h = self.help(path)
        if h is None:
            R.fail(where, f"`{shown}`: ember has no such command")
            return
        flags, envs, required, _ = h
        bad, upcoming = [], []
        for f in flags_of(rest):
            if f in flags:
                continue
            (upcoming if (path[-1], f) in UPCOMING_FLAGS else bad).append(f)
        if path in (("node",), ("gateway",)):
            known_env = set(envs.values()) | RUNTIME_ENV
            for e in env_names:
                if e.startswith("EMBER_") and e not in known_env:
                    (upcoming if (path[0], e) in UPCOMING_ENV else bad).append(e)
        missing = [f for f in sorted(required)
                   if f not in flags_of(rest) and envs.get(f) not in env_names]
        if upcoming:
            R.warn(where, f"`{shown}`: {', '.join(upcoming)} not in this ember's help yet; "
                          "accepted as known-upcoming")
        if bad:
            R.fail(where, f"`{shown}`: unknown to ember: {', '.join(bad)}")
        if missing:
            R.fail(where, f"`{shown}`: required but given neither as a flag nor in the "
                          "environment: "
                          + ", ".join(f + (f" ({envs[f]})" if f in envs else "")
                                      for f in missing))
        if not bad and not missing:
            R.ok(where, f"`{shown}`: every flag and variable is ember's "
                        f"({len(flags_of(rest))} flags), required options given")


CLI = None  # EmberCli, or None without a binary


def check_call(where, args, env_names=()):
    if CLI:
        CLI.check_call(where, args, env_names)


def find_call(calls, path):
    """The first call among `calls` running `ember PATH...`."""
    for c in calls:
        if command_path(c)[0] == path:
            return c
    return None


def port_of(addr):
    m = re.search(r":(\d+)$", addr or "")
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------------------
# Kubernetes


def load_yaml_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def pod_spec(obj):
    if obj.get("kind") in WORKLOADS:
        return obj.get("spec", {}).get("template", {}).get("spec", {})
    return {}


def containers(obj):
    spec = pod_spec(obj)
    return spec.get("initContainers", []) + spec.get("containers", [])


def render(kdir, root):
    """The objects kustomize would render from directory `kdir`, as (file, object) pairs."""
    kfile = kdir / "kustomization.yaml"
    where = rel(kfile, root)
    k = yaml.safe_load(kfile.read_text())
    supported = {"apiVersion", "kind", "namespace", "labels", "resources", "images"}
    unknown = set(k) - supported
    if unknown:
        # Anything else would be silently left out of what is validated.
        R.fail(where, f"this renderer supports only {', '.join(sorted(supported))}; "
                      f"found {', '.join(sorted(unknown))} (extend scripts/validate-deploy.py)")
    out = []
    for res in k.get("resources", []):
        p = (kdir / res).resolve()
        if p.is_dir():
            out += render(p, root)
        elif p.is_file():
            out += [(rel(p, root), d) for d in load_yaml_docs(p)]
        else:
            R.fail(where, f"resource {res} does not exist")
    for img in k.get("images", []):
        for _, obj in out:
            for c in containers(obj):
                name = re.split(r"[:@]", c.get("image", ""), maxsplit=1)[0]
                if name == img["name"]:
                    image = img.get("newName", name)
                    if "digest" in img:
                        image += "@" + img["digest"]
                    elif "newTag" in img:
                        image += ":" + str(img["newTag"])
                    c["image"] = image
    for lab in k.get("labels", []):
        pairs = lab.get("pairs", {})
        for _, obj in out:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
            if obj.get("kind") in WORKLOADS and (lab.get("includeTemplates")
                                                 or lab.get("includeSelectors")):
                t = obj["spec"]["template"].setdefault("metadata", {})
                t.setdefault("labels", {}).update(pairs)
            if lab.get("includeSelectors"):
                if obj.get("kind") in WORKLOADS:
                    obj["spec"]["selector"].setdefault("matchLabels", {}).update(pairs)
                elif obj.get("kind") == "Service":
                    obj["spec"].setdefault("selector", {}).update(pairs)
    if "namespace" in k:
        for _, obj in out:
            if obj.get("kind") not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = k["namespace"]
    return out


def obj_id(obj):
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def schema_errors(obj, version):
    """Every error of obj against the strict schema of `version`, as "path: message".
    kubernetes_validate.validate() stops at the first; this is the same schema lookup
    (kubernetes_validate.utils, pinned) with all of jsonschema's errors."""
    kv = kubernetes_validate.utils
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", obj["apiVersion"])
    schema_dir = f"v{version}.0-local-strict"
    try:
        schema = kv.schema_contents(f"kubernetes-json-schema/{schema_dir}/"
                                    f"{obj['kind'].lower()}-{api}.json", version)
    except FileNotFoundError:
        raise kv.SchemaNotFoundError(kind=obj["kind"], version=version,
                                     api_version=obj["apiVersion"]) from None
    defs = kv.schema_contents(f"kubernetes-json-schema/{schema_dir}/_definitions.json", version)
    registry = kv.Resource.from_contents(defs) @ (kv.Resource.from_contents(schema)
                                                  @ kv.Registry())
    validator = kv.jsonschema.validators.Draft202012Validator(schema, registry=registry)
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '(top level)'}: {e.message}"
            for e in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))]


def validate_schemas(label, objs, quiet=False):
    """Each object against the strict schemas of every version in K8S_VERSIONS (quiet: one
    line for all that pass)."""
    seen, passed = set(), 0
    for where, obj in objs:
        key = (obj.get("kind"), obj.get("metadata", {}).get("namespace"),
               obj.get("metadata", {}).get("name"))
        if key in seen:
            R.fail(where, f"{obj_id(obj)} is defined twice in {label}")
        seen.add(key)
        errors = {}  # message: the versions that give it
        for version in K8S_VERSIONS:
            try:
                found = schema_errors(obj, version)
            except kubernetes_validate.SchemaNotFoundError as e:
                found = [e.message]
            except Exception as e:  # a malformed object: no kind, apiVersion...
                found = [f"cannot validate: {e}"]
            for e in found:
                errors.setdefault(e, []).append(version)
        if errors:
            R.fail(where, f"{obj_id(obj)} ({label}): " + "; ".join(
                f"{e} (Kubernetes {', '.join(v)})" for e, v in errors.items()))
        elif quiet:
            passed += 1
        else:
            R.ok(where, f"{obj_id(obj)} ({label}) valid against Kubernetes "
                        f"{', '.join(K8S_VERSIONS)} (strict: no unknown field, every type)")
    if passed:
        R.ok(label, f"{passed} objects valid against Kubernetes {', '.join(K8S_VERSIONS)} "
                    "(strict)")


def env_names(container):
    return [e["name"] for e in container.get("env", []) if "name" in e]


def check_env_refs(where, obj):
    """`$(NAME)` in command, args and env values refers to a variable defined before it
    (Kubernetes leaves an unknown one as it is, silently)."""
    for c in containers(obj):
        defined = set()
        texts = []
        for e in c.get("env", []):
            if "value" in e:
                texts.append((e["value"], set(defined)))
            defined.add(e.get("name"))
        texts += [(w, defined) for w in c.get("command", []) + c.get("args", [])]
        for text, known in texts:
            for name in re.findall(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(text)):
                if name not in known:
                    R.fail(where, f"{obj_id(obj)} container {c.get('name')}: $({name}) is "
                                  "not a variable defined before it")


def container_port(container, port):
    """The number a probe's `port` (a number or a port name) means."""
    if isinstance(port, int):
        return port
    for p in container.get("ports", []):
        if p.get("name") == port:
            return p.get("containerPort")
    return None


def check_probe(where, obj, container, kind, path, want_port):
    probe = container.get(kind)
    get = (probe or {}).get("httpGet", {})
    R.check(probe and get.get("path") == path
            and container_port(container, get.get("port")) == want_port,
            where, f"{obj_id(obj)}: {kind} GET {path} on port {want_port}",
            f"{obj_id(obj)}: {kind} must be an httpGet of {path} on port {want_port} "
            f"(found {probe!r})")


def find_obj(objs, kind, name):
    for where, obj in objs:
        if obj.get("kind") == kind and obj.get("metadata", {}).get("name") == name:
            return where, obj
    return None, None


def check_k8s_node(objs):
    where, ds = find_obj(objs, "DaemonSet", "ember-node")
    if not ds:
        R.fail("deploy/kubernetes/base", "no DaemonSet ember-node")
        return
    spec = pod_spec(ds)
    name = obj_id(ds)
    R.check(spec.get("nodeSelector"), where, f"{name}: nodeSelector {spec.get('nodeSelector')}",
            f"{name}: no nodeSelector (it would run on hosts without KVM)")
    R.check(spec.get("hostNetwork") is True, where, f"{name}: hostNetwork",
            f"{name}: hostNetwork must be true (TAP devices, namespaces and nftables rules "
            "are the host's)")
    R.check(spec.get("dnsPolicy") == "ClusterFirstWithHostNet", where,
            f"{name}: dnsPolicy ClusterFirstWithHostNet",
            f"{name}: dnsPolicy must be ClusterFirstWithHostNet with hostNetwork")
    grace = spec.get("terminationGracePeriodSeconds", 30)
    R.check(isinstance(grace, int) and grace >= MIN_STOP_SECS, where,
            f"{name}: terminationGracePeriodSeconds {grace} (room for a drain)",
            f"{name}: terminationGracePeriodSeconds {grace!r} must be a number of seconds, "
            f"at least {MIN_STOP_SECS}: the time a drain has")
    c = next((c for c in spec.get("containers", [])
              if find_call(ember_calls(c.get("command", []) + c.get("args", [])),
                           ("node",)) is not None), None)
    if not c:
        R.fail(where, f"{name}: no container runs `ember node`")
        return
    sc = c.get("securityContext", {})
    caps = set(sc.get("capabilities", {}).get("add", []))
    R.check(sc.get("privileged") is True or NODE_CAPS <= caps, where,
            f"{name}: " + ("privileged" if sc.get("privileged") else "capabilities"),
            f"{name}: neither privileged nor the capabilities {sorted(NODE_CAPS - caps)}")
    mounts = {m.get("mountPath"): m.get("name") for m in c.get("volumeMounts", [])}
    vols = {v.get("name"): v for v in spec.get("volumes", [])}

    def host_path_at(mount_path):
        return vols.get(mounts.get(mount_path), {}).get("hostPath", {})

    for dev in NODE_DEVICES:
        hp = host_path_at(dev)
        R.check(hp.get("path") == dev and hp.get("type") == "CharDevice", where,
                f"{name}: {dev} from the host (CharDevice)",
                f"{name}: {dev} must be mounted from a hostPath of type CharDevice")
    envs = {e["name"]: e for e in c.get("env", []) if "name" in e}
    for var, default in (("EMBER_HOME", "/var/lib/ember"), ("EMBER_CACHE", "/var/cache/ember")):
        path = envs.get(var, {}).get("value", default)
        R.check(host_path_at(path).get("path"), where, f"{name}: {var} {path} on the host",
                f"{name}: {var} ({path}) must be a hostPath mount (state outlives the pod)")
    node_id = envs.get("EMBER_NODE_ID", {}).get("valueFrom", {}).get("fieldRef", {})
    R.check(node_id.get("fieldPath") == "spec.nodeName", where,
            f"{name}: EMBER_NODE_ID from spec.nodeName",
            f"{name}: EMBER_NODE_ID must come from the downward API (spec.nodeName)")
    args = find_call(ember_calls(c.get("command", []) + c.get("args", [])), ("node",))
    check_call(where, args, envs.keys())
    listen = flag_value(args, "--internal-listen") or envs.get("EMBER_INTERNAL_LISTEN", {}).get(
        "value")
    port = port_of(listen)
    if R.check(port is not None, where, f"{name}: internal API on port {port}",
               f"{name}: --internal-listen has no port ({listen!r})"):
        # Readiness: 503 while the node drains or is fenced. Liveness: the process answers
        # (a draining or fenced node must not be restarted for it).
        check_probe(where, ds, c, "readinessProbe", NODE_HEALTH, port)
        check_probe(where, ds, c, "livenessProbe", NODE_LIVE, port)
    pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    drain = find_call(ember_calls(pre), ("cluster", "drain"))
    R.check(drain is not None and "--wait" in flags_of(drain), where,
            f"{name}: preStop runs `ember cluster drain --wait`",
            f"{name}: preStop must run `ember cluster drain --wait` (found {pre!r})")
    if drain is not None:
        check_call(where, drain)
    check_env_refs(where, ds)


def check_k8s_gateway(objs):
    where, dep = find_obj(objs, "Deployment", "ember-gateway")
    if not dep:
        R.fail("deploy/kubernetes/base", "no Deployment ember-gateway")
        return
    name = obj_id(dep)
    replicas = dep.get("spec", {}).get("replicas", 1)
    R.check(isinstance(replicas, int) and replicas >= 2, where, f"{name}: {replicas} replicas",
            f"{name}: {replicas} replica(s): one gateway is a single point of failure")
    c = next((c for c in pod_spec(dep).get("containers", [])
              if find_call(ember_calls(c.get("command", []) + c.get("args", [])),
                           ("gateway",)) is not None), None)
    if not c:
        R.fail(where, f"{name}: no container runs `ember gateway`")
        return
    envs = {e["name"]: e for e in c.get("env", []) if "name" in e}
    args = find_call(ember_calls(c.get("command", []) + c.get("args", [])), ("gateway",))
    check_call(where, args, envs.keys())
    listen = flag_value(args, "--listen") or envs.get("EMBER_LISTEN", {}).get("value")
    R.check(listen and not listen.startswith(("127.", "localhost", "[::1]")), where,
            f"{name}: listens on {listen}",
            f"{name}: --listen {listen!r}: a gateway in a pod must listen beyond loopback")
    port = port_of(listen)
    check_probe(where, dep, c, "readinessProbe", GATEWAY_HEALTH, port)
    check_env_refs(where, dep)
    swhere, svc = find_obj(objs, "Service", "ember-gateway")
    if not svc:
        R.fail(where, "no Service ember-gateway")
        return
    sel = svc.get("spec", {}).get("selector", {})
    labels = dep["spec"]["template"].get("metadata", {}).get("labels", {})
    targets = [container_port(c, p.get("targetPort", p.get("port")))
               for p in svc.get("spec", {}).get("ports", [])]
    R.check(sel and sel.items() <= labels.items() and port in targets, swhere,
            f"Service/ember-gateway selects the gateway pods, port {port}",
            f"Service/ember-gateway must select the gateway's pods ({sel} vs {labels}) and "
            f"target its port {port} (targets {targets})")


def secret_refs(objs):
    """(file, object, key) for each key of ember-secrets that a manifest needs."""
    refs = []
    for where, obj in objs:
        for c in containers(obj):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref.get("name") == SECRET_NAME and not ref.get("optional"):
                    refs.append((where, obj, ref.get("key")))
        for v in pod_spec(obj).get("volumes", []):
            s = v.get("secret")
            if s and s.get("secretName") == SECRET_NAME and not s.get("optional"):
                refs += [(where, obj, i.get("key")) for i in s.get("items", [])]
    return refs


def check_secrets(kroot, root, base_objs, overlays):
    template = kroot / "ember-secrets.example.yaml"
    twhere = rel(template, root)
    if not template.is_file():
        R.fail(twhere, "missing (the Secret template the base reads)")
        return
    docs = load_yaml_docs(template)
    validate_schemas("template", [(twhere, d) for d in docs])
    secret = next((d for d in docs if d.get("kind") == "Secret"
                   and d.get("metadata", {}).get("name") == SECRET_NAME), None)
    if not secret:
        R.fail(twhere, f"no Secret {SECRET_NAME}")
        return
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    values = secret.get("stringData", {})
    real = [k for k in SECRET_PLACEHOLDER_KEYS if "REPLACE" not in str(values.get(k, ""))]
    R.check(not real, twhere, "every secret value is a REPLACE-ME placeholder",
            f"must hold placeholders only (REPLACE-ME), not values: {', '.join(real)}")
    in_base = [w for w, o in base_objs if o.get("kind") == "Secret"]
    R.check(not in_base, "deploy/kubernetes/base", "holds no Secret (yours is applied apart)",
            f"holds a Secret ({', '.join(in_base)}): `kubectl apply -k` would overwrite the "
            "operator's")
    missing = sorted({(w, k) for w, _, k in secret_refs(base_objs) if k not in keys})
    for w, k in missing:
        R.fail(w, f"reads key {k!r} of {SECRET_NAME}, which the template {twhere} lacks")
    if not missing:
        R.ok(twhere, f"has every key the base reads ({len(keys)} keys)")
    for label, objs in overlays:
        secrets = {o["metadata"]["name"]: o for _, o in objs if o.get("kind") == "Secret"}
        lacking = sorted({(w, k) for w, o, k in secret_refs(objs)
                          if SECRET_NAME in secrets
                          and k not in set(secrets[SECRET_NAME].get("stringData", {}))
                          | set(secrets[SECRET_NAME].get("data", {}))})
        for w, k in lacking:
            R.fail(w, f"reads key {k!r} of {SECRET_NAME}, which {label}'s Secret lacks")
        if SECRET_NAME in secrets and not lacking:
            R.ok(label, f"its Secret {SECRET_NAME} has every key its manifests read")


def check_kubernetes(deploy, root):
    kroot = deploy / "kubernetes"
    base = render(kroot / "base", root)
    validate_schemas("base", base)
    check_k8s_node(base)
    check_k8s_gateway(base)
    overlays = []
    for kfile in sorted((kroot / "overlays").glob("*/kustomization.yaml")):
        label = rel(kfile.parent, root)
        objs = render(kfile.parent, root)
        validate_schemas(label, [(w, o) for w, o in objs if "/base/" not in w])
        validate_schemas(f"{label}, the base's objects as it renders them",
                         [(w, o) for w, o in objs if "/base/" in w], quiet=True)
        overlays.append((label, objs))
    check_secrets(kroot, root, base, overlays)


# --------------------------------------------------------------------------------------
# Nomad

HCL_OPTIONS = SerializationOptions(with_comments=False, explicit_blocks=False,
                                   preserve_heredocs=True, strip_string_quotes=True)


def unheredoc(value):
    """A heredoc's text (`<<EOT` as it is, `<<-EOT` with its indentation removed)."""
    if not isinstance(value, str):
        return value
    m = re.match(r"^<<(-?)(\w+)\n(.*?)\n?[ \t]*\2$", value, re.S)
    if not m:
        return value
    return textwrap.dedent(m.group(3)) if m.group(1) else m.group(3)


def blocks(d, name):
    """The labelled blocks `name "label" {...}` of d, as (label, body) pairs."""
    out = []
    for item in d.get(name, []):
        out += list(item.items()) if isinstance(item, dict) else []
    return out


def block(d, name):
    """The unlabelled blocks `name {...}` of d."""
    v = d.get(name, [])
    return v if isinstance(v, list) else [v]


def duration_secs(text):
    """Seconds in a Go duration ("300s", "5m", "1m30s"), or None."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(text))
    if not parts or "".join(n + u for n, u in parts) != str(text):
        return None
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


def nomad_task_env(task):
    """Variables a task gets: its env block and the env templates' NAME= lines."""
    names = set()
    for e in block(task, "env"):
        names |= set(e)
    for t in block(task, "template"):
        if t.get("env"):
            names |= set(re.findall(r"^\s*(?:\{\{.*?\}\})?\s*([A-Z_][A-Z0-9_]*)=",
                                    unheredoc(t.get("data", "")), re.M))
    return names


def nomad_port_label(value):
    """The port label behind ${NOMAD_ADDR_x} / $NOMAD_PORT_x in a value, or None."""
    m = re.search(r"NOMAD_(?:ADDR|PORT|HOST_PORT)_(\w+?)\}?(?:\"|$|\W)", (value or "") + " ")
    return m.group(1) if m else None


def check_nomad_job(path, root, kind):
    where = rel(path, root)
    try:
        with open(path) as f:
            doc = hcl2.load(f, serialization_options=HCL_OPTIONS)
    except Exception as e:
        R.fail(where, f"does not parse as HCL: {e}")
        return
    jobs = blocks(doc, "job")
    if len(jobs) != 1:
        R.fail(where, f"expected one job block, found {len(jobs)}")
        return
    name, job = jobs[0]
    want_type = "system" if kind == "node" else "service"
    R.check(job.get("type") == want_type, where, f"job {name}: type = {want_type!r}",
            f"job {name}: type must be {want_type!r} (found {job.get('type')!r})")
    if kind == "node":
        cons = [c for c in block(job, "constraint") if "kvm" in str(c.get("attribute", ""))]
        R.check(cons, where, f"job {name}: constrained to KVM hosts ({cons[0]['attribute']})"
                if cons else "", f"job {name}: no constraint on a kvm attribute or meta (it "
                                 "would run on hosts without KVM)")
    groups = blocks(job, "group")
    calls = []
    for gname, group in groups:
        ports = {}
        for net in block(group, "network"):
            for label, p in blocks(net, "port"):
                ports[label] = p
        if kind == "gateway":
            count = group.get("count", 1)
            R.check(isinstance(count, int) and count >= 2, where,
                    f"group {gname}: count = {count}",
                    f"group {gname}: count = {count}: one gateway is a single point of failure")
        checks = []
        for svc in block(group, "service"):
            for chk in block(svc, "check"):
                checks.append((svc.get("port"), chk))
        for tname, task in blocks(group, "task"):
            tw = f"{where}: task {tname}"
            driver = task.get("driver")
            cfg = (block(task, "config") or [{}])[0]
            argv = [unheredoc(cfg.get("command", ""))] + [unheredoc(a)
                                                          for a in cfg.get("args", [])]
            task_calls = ember_calls(argv)
            calls += task_calls
            env = nomad_task_env(task)
            main = find_call(task_calls, (kind,))
            if main is None:
                R.fail(tw, f"does not run `ember {kind}` (command {argv[:2]!r})")
                continue
            R.ok(tw, f"runs `ember {kind}` with driver {driver}")
            check_call(tw, main, env)
            if kind == "node":
                R.check(driver == "raw_exec", tw, "driver raw_exec (root, the host's devices)",
                        f"driver {driver!r}: the node needs raw_exec (root, /dev/kvm, host "
                        "network, cgroups), which exec's isolation takes away")
                kt = task.get("kill_timeout")
                secs = duration_secs(kt) if kt is not None else None
                if kt is None:
                    R.fail(tw, "no kill_timeout (Nomad's default, 5s, leaves no time for a "
                               f"drain; at least {MIN_STOP_SECS}s)")
                else:
                    R.check(secs is not None and secs >= MIN_STOP_SECS, tw,
                            f"kill_timeout = {kt!r} (room for a drain)",
                            f"kill_timeout = {kt!r} is under {MIN_STOP_SECS}s: no time for a "
                            "drain")
                drain = find_call(task_calls, ("cluster", "drain"))
                R.check(drain is not None and "--wait" in flags_of(drain), tw,
                        "drains (`ember cluster drain --wait`) on the kill signal",
                        "must run `ember cluster drain --wait` when stopped")
                if drain is not None:
                    check_call(tw, drain)
                listen = flag_value(main, "--internal-listen")
                health = NODE_HEALTH
            else:
                listen = flag_value(main, "--listen")
                health = GATEWAY_HEALTH
            label = nomad_port_label(listen)
            if label is None:
                label = next((lb for lb, p in ports.items()
                              if p.get("static") == port_of(listen)), None)
            R.check(label in ports, tw, f"listens on port {label!r} of the group's network",
                    f"listens on {listen!r}, which is no port of the group's network "
                    f"({', '.join(ports) or 'none'})")
            ok = [c for port, c in checks
                  if port == label and c.get("type") == "http" and c.get("path") == health]
            R.check(ok, tw, f"service check: http GET {health} on port {label!r}",
                    f"needs a service check of type http on {health}, port {label!r} "
                    f"(found {[c for _, c in checks]!r})")
    if not groups:
        R.fail(where, f"job {name}: no group")


def check_nomad(deploy, root):
    ndir = deploy / "nomad"
    for kind in ("node", "gateway"):
        path = ndir / f"ember-{kind}.nomad.hcl"
        if path.is_file():
            check_nomad_job(path, root, kind)
        else:
            R.fail(rel(path, root), "missing")


# --------------------------------------------------------------------------------------
# systemd


def parse_unit(path):
    """(section, key, value, line number) of each assignment; continuation lines joined."""
    out, section, pending, start = [], None, "", 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not pending:
            start = n
            stripped = line.strip()
            if not stripped or stripped[0] in "#;":
                continue
            if stripped.startswith("["):
                section = stripped.strip("[]")
                continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text, pending = pending + line, ""
        if "=" in text:
            key, value = text.split("=", 1)
            out.append((section, key.strip(), value.strip(), start))
    return out


def unit_values(entries, key, section="Service"):
    return [v for s, k, v, _ in entries if s == section and k == key]


def systemd_secs(text):
    """Seconds in a systemd time span ("330", "5min 30s", "infinity" = None)."""
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        return int(text)
    units = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "ms": 0.001}
    parts = re.findall(r"(\d+)\s*([a-z]+)", text)
    if not parts or any(u not in units for _, u in parts):
        return None
    return sum(int(n) * units[u] for n, u in parts)


def exec_argv(value):
    """An Exec*= line's argv, without its prefixes (-, @, :, +, !)."""
    return shlex.split(value.lstrip("-@:+!"))


def env_file_names(deploy, entries):
    """Variables the unit gives: Environment= and the EnvironmentFile='s example beside it
    (/etc/ember/NAME.env ↔ deploy/systemd/NAME.env.example)."""
    names = set()
    for v in unit_values(entries, "Environment"):
        names |= {w.split("=", 1)[0] for w in shlex.split(v)}
    for v in unit_values(entries, "EnvironmentFile"):
        example = deploy / "systemd" / (Path(v.lstrip("-")).name + ".example")
        if example.is_file():
            for line in example.read_text().splitlines():
                m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=", line)
                if m:
                    names.add(m.group(1))
        else:
            R.fail(rel(example, deploy), f"missing: the example of {v}")
    return names


def systemd_verify(units, root):
    """`systemd-analyze verify` on copies whose `ember` is a stub; any line it prints about
    a unit fails it."""
    tool = shutil.which("systemd-analyze")
    if not tool:
        for u in units:
            R.fail(rel(u, root), "systemd-analyze not found: install Debian's `systemd` "
                                 "package (scripts/test-prereqs.sh does)")
        return
    with tempfile.TemporaryDirectory(prefix="ember-units.") as tmp:
        stub = Path(tmp) / "bin" / "ember"
        stub.parent.mkdir()
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
        copies = []
        for u in units:
            text = re.sub(r"(?<![\w/])/[\w./-]*/ember(?=[\s'\"]|$)", str(stub), u.read_text(),
                          flags=re.M)
            copy = Path(tmp) / u.name
            copy.write_text(text)
            copies.append(copy)
        for u, copy in zip(units, copies):
            out = subprocess.run([tool, "verify", str(copy)], capture_output=True, text=True,
                                 cwd=tmp)
            lines = [ln for ln in (out.stdout + out.stderr).splitlines()
                     if u.name in ln or str(copy) in ln]
            lines = [ln.replace(str(copy), u.name).replace(str(stub), "<ember>")
                     for ln in lines]
            R.check(out.returncode == 0 and not lines, rel(u, root),
                    "systemd-analyze verify: clean (its ember path pointed at a stub)",
                    "systemd-analyze verify: " + ("; ".join(lines) or
                                                  f"exit {out.returncode}: {out.stderr.strip()}"))


def check_systemd(deploy, root):
    sdir = deploy / "systemd"
    units = {k: sdir / f"ember-{k}.service" for k in ("node", "gateway")}
    for k, u in units.items():
        if not u.is_file():
            R.fail(rel(u, root), "missing")
            return
    systemd_verify(list(units.values()), root)
    for kind, u in units.items():
        where = rel(u, root)
        entries = parse_unit(u)
        env = env_file_names(deploy, entries)
        starts = unit_values(entries, "ExecStart")
        main = find_call(ember_calls(exec_argv(starts[0])) if starts else [], (kind,))
        if main is None:
            R.fail(where, f"ExecStart does not run `ember {kind}`")
            continue
        R.ok(where, f"ExecStart runs `ember {kind}`")
        # `${NAME}` in the command line: substituted by systemd from its environment.
        own = {v for w in starts for v in re.findall(r"\$\{(\w+)\}", w)}
        undefined = sorted(own - env)
        R.check(not undefined, where, "ExecStart's ${...} are all set by the unit",
                f"ExecStart uses {', '.join(undefined)}, set by neither Environment= nor the "
                "EnvironmentFile's example")
        # Variables the unit substitutes itself are for it, not for ember.
        check_call(where, main, env - own)
        restart = unit_values(entries, "Restart")
        R.check(restart == ["always"], where, "Restart=always",
                f"Restart must be always (found {restart or 'none'})")
        if kind == "node":
            km = unit_values(entries, "KillMode")
            R.check(km == ["process"], where, "KillMode=process (VMMs outlive a restart)",
                    f"KillMode must be process, so that the VMMs survive the node (found "
                    f"{km or 'the default, control-group'})")
            stop = unit_values(entries, "TimeoutStopSec")
            secs = systemd_secs(stop[-1]) if stop else None
            R.check(secs is not None and secs >= MIN_STOP_SECS, where,
                    f"TimeoutStopSec={stop[-1] if stop else ''} (room for a drain)",
                    f"TimeoutStopSec must be at least {MIN_STOP_SECS}s for a drain (found "
                    f"{stop[-1] if stop else 'the default, 90s, implicit'})")
            drains = [c for v in unit_values(entries, "ExecStop")
                      for c in ember_calls(exec_argv(v.replace("$$", "$")))
                      if command_path(c)[0] == ("cluster", "drain")]
            R.check(drains and "--wait" in flags_of(drains[0]), where,
                    "ExecStop runs `ember cluster drain --wait`",
                    "ExecStop must run `ember cluster drain --wait`")
            if drains:
                check_call(where, drains[0])
            users = unit_values(entries, "User") + unit_values(entries, "DynamicUser")
            R.check(not users or users == ["root"], where, "runs as root",
                    f"the node needs root (found {users})")
        else:
            want = {"NoNewPrivileges": "yes", "ProtectSystem": "strict",
                    "CapabilityBoundingSet": "", "PrivateDevices": "yes"}
            wrong = [f"{k}={v}" for k, v in want.items() if unit_values(entries, k) != [v]]
            dyn = unit_values(entries, "DynamicUser") == ["yes"]
            user = unit_values(entries, "User")
            if not dyn and (not user or user == ["root"]):
                wrong.append("DynamicUser=yes (or a User= other than root)")
            R.check(not wrong, where, "hardened (unprivileged user, no capabilities, "
                                      "read-only system, no devices)",
                    f"the gateway needs no privilege; missing: {', '.join(wrong)}")


# --------------------------------------------------------------------------------------


def main():
    repo = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deploy", type=Path, default=repo / "deploy",
                    help="the tree to check (default: the repository's deploy/)")
    ap.add_argument("--ember", type=Path,
                    help="an ember binary for the flag checks (default: $EMBER_BIN, else "
                         "${CARGO_TARGET_DIR:-target}/debug/ember)")
    a = ap.parse_args()
    deploy = a.deploy.resolve()
    root = deploy  # paths are printed as deploy/...
    binary = a.ember or (Path(os.environ["EMBER_BIN"]) if os.environ.get("EMBER_BIN") else
                         repo / os.environ.get("CARGO_TARGET_DIR", "target") / "debug" / "ember")
    global CLI
    if binary.is_file() and os.access(binary, os.X_OK):
        CLI = EmberCli(binary)
        if CLI.help(()) is None:
            R.fail(str(binary), "`ember --help` failed")
            CLI = None
        else:
            print(f"note  ember's flags from {binary}")
    else:
        R.warn(str(binary), "no ember binary: flags and variables are not checked against "
                            "ember's help (set EMBER_BIN or build it)")
    print(f"note  Kubernetes schemas of kubernetes-validate {kubernetes_validate.__version__}")
    check_kubernetes(deploy, root)
    check_nomad(deploy, root)
    check_systemd(deploy, root)
    if R.failed:
        print(f"validate-deploy: {R.failed} of {R.passed + R.failed} checks FAILED")
        return 1
    print(f"validate-deploy: all {R.passed} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The E2B Python SDK against ember's secrets and network rules (driven by tests/secrets.rs).

Env: E2B_API_KEY, E2B_API_URL = E2B_SANDBOX_URL = the server; EMBER_TEST_SECRET (the value;
never printed). Creates a secret with `Secret.create` (rotated with `Secret.update`, removed with `Secret.destroy`), a sandbox whose `network.rules` put
`Bearer ${e2b.secrets.<name>}` on requests to api.test, runs a request from the sandbox that
carries no credential, reads the sandbox's detail as the API returns it, and prints one JSON
line for the Rust side to check (what the guest printed, the network the API shows, the listed
secrets' names).
"""

import json
import os
import urllib.request

from e2b import Sandbox, Secret

value = os.environ["EMBER_TEST_SECRET"]
value2 = os.environ["EMBER_TEST_SECRET2"]
name = "openai-key"
created = Secret.create(name, value, metadata={"description": "test key"})
placeholder = Secret.fill(name)
sbx = Sandbox.create(
    template="base",
    timeout=300,
    network={
        "allow_out": ["api.test"],
        "rules": {
            "api.test": [
                {"transform": {"headers": {"Authorization": f"Bearer {placeholder}"}}}
            ]
        },
    },
)
try:
    r = sbx.commands.run(
        "python3 -c \"import urllib.request as u; "
        "r = u.urlopen('https://api.test/e2b-sdk', timeout=20); "
        "print(r.status, r.read().decode())\"",
        timeout=120,
    )
    out = r.stdout.strip()
    rotated = Secret.update(name, value2)
    r = sbx.commands.run(
        "python3 -c \"import urllib.request as u; "
        "print(u.urlopen('https://api.test/e2b-rotated', timeout=20).status)\"",
        timeout=120,
    )
    out_rotated = r.stdout.strip()
    info = Secret.get_info(name)
    req = urllib.request.Request(
        os.environ["E2B_API_URL"] + f"/sandboxes/{sbx.sandbox_id}",
        headers={"X-API-Key": os.environ["E2B_API_KEY"]},
    )
    detail = json.load(urllib.request.urlopen(req))
    listed = [s.name for s in Secret.list().next_items()]
finally:
    sbx.kill()
gone = Secret.destroy(name)
print(
    json.dumps(
        {
            "version": created.version,
            "rotated_version": rotated.version,
            "info_name": info.name,
            "out_rotated": out_rotated,
            "destroyed": gone,
            "out": out,
            "network": detail.get("network"),
            "listed": listed,
            "after_delete": [s.name for s in Secret.list().next_items()],
        }
    )
)

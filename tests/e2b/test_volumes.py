"""The E2B Python SDK's `Volume` class against ember (driven by tests/volumes.rs).

Env: E2B_API_KEY, E2B_API_URL = E2B_SANDBOX_URL = E2B_VOLUME_API_URL = the server. Creates a
volume, mounts it into sandbox A (`volume_mounts`), writes from the guest, kills A, reads the
file with `Volume.read_file`, writes one with `Volume.write_file` that sandbox B reads, lists,
makes a directory, removes, and prints one JSON line for the Rust side to check.
"""

import json

from e2b import Sandbox, Volume

vol = Volume.create("e2b-vol")
a = Sandbox.create(template="base", timeout=300, volume_mounts={"/mnt/vol": vol})
try:
    a.commands.run("echo from-guest > /mnt/vol/guest.txt", timeout=120)
finally:
    a.kill()
from_guest = vol.read_file("/guest.txt")
vol.write_file("/sdk/host.txt", "from-sdk")
b = Sandbox.create(template="base", timeout=300, volume_mounts={"/data": "e2b-vol"})
try:
    in_b = b.commands.run("cat /data/sdk/host.txt", timeout=120).stdout
finally:
    b.kill()
vol.make_dir("/made/deep", force=True)
listed = sorted(e.name for e in vol.list("/"))
vol.remove("/made")
after = sorted(e.name for e in vol.list("/"))
info = Volume.get_info(vol.volume_id)
names = [v.name for v in Volume.list()]
destroyed = Volume.destroy(vol.volume_id)
print(
    json.dumps(
        {
            "from_guest": from_guest,
            "in_b": in_b,
            "listed": listed,
            "after": after,
            "info_name": info.name,
            "names": names,
            "destroyed": destroyed,
        }
    )
)

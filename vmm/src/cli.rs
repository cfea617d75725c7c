//! Parsers for the device specifications the command lines take (`ember-vmm` and `ember`):
//! `--disk path=..,mode=ro|rw|overlay,base=..,id=..`, `--net tap=..,mac=..`,
//! `--vsock cid=..,uds=..`, and sizes (`--serial-max-bytes 4M`).

use std::path::PathBuf;

use ember_devices::virtio::block::{BlockConfig, BlockMode};
use ember_devices::virtio::net::NetConfig;
use ember_devices::virtio::vsock::VsockConfig;

fn key_values(s: &str) -> Result<Vec<(&str, &str)>, String> {
    s.split(',')
        .map(|kv| {
            kv.split_once('=')
                .ok_or_else(|| format!("option {kv:?} is not key=value"))
        })
        .collect()
}

pub fn parse_net(s: &str) -> Result<NetConfig, String> {
    let mut tap = None;
    let mut mac = None;
    for (k, v) in key_values(s)? {
        match k {
            "tap" => tap = Some(v.to_string()),
            "mac" => mac = Some(v.to_string()),
            other => return Err(format!("unknown --net option {other:?} (tap, mac)")),
        }
    }
    Ok(NetConfig {
        tap: tap.ok_or("--net needs tap=NAME")?,
        mac,
    })
}

pub fn parse_vsock(s: &str) -> Result<VsockConfig, String> {
    let mut cid = None;
    let mut uds = None;
    for (k, v) in key_values(s)? {
        match k {
            "cid" => {
                cid = Some(
                    v.parse::<u64>()
                        .map_err(|e| format!("vsock cid {v:?}: {e}"))?,
                )
            }
            "uds" => uds = Some(PathBuf::from(v)),
            other => return Err(format!("unknown --vsock option {other:?} (cid, uds)")),
        }
    }
    Ok(VsockConfig {
        guest_cid: cid.ok_or("--vsock needs cid=N")?,
        uds_path: uds.ok_or("--vsock needs uds=PATH")?,
    })
}

pub fn parse_disk(s: &str) -> Result<BlockConfig, String> {
    let mut path = None;
    let mut mode = BlockMode::ReadWrite;
    let mut base: Option<PathBuf> = None;
    let mut overlay = false;
    let mut id = String::new();
    if !s.contains('=') {
        path = Some(PathBuf::from(s));
    } else {
        for kv in s.split(',') {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("disk option {kv:?} is not key=value"))?;
            match k {
                "path" => path = Some(PathBuf::from(v)),
                "mode" => match v {
                    "ro" => mode = BlockMode::ReadOnly,
                    "rw" => mode = BlockMode::ReadWrite,
                    "overlay" => overlay = true,
                    other => {
                        return Err(format!("disk mode {other:?}: expected ro, rw or overlay"))
                    }
                },
                "base" => base = Some(PathBuf::from(v)),
                "id" => id = v.to_string(),
                other => return Err(format!("unknown disk option {other:?}")),
            }
        }
    }
    let path = path.ok_or("disk needs path=...")?;
    match (overlay, base) {
        (true, Some(base)) => mode = BlockMode::Overlay { base },
        (true, None) => return Err("mode=overlay needs base=IMAGE (path= is the overlay)".into()),
        (false, Some(_)) => return Err("base= only goes with mode=overlay".into()),
        (false, None) => {}
    }
    if id.len() > 20 {
        return Err(format!("disk id {id:?} is longer than 20 bytes"));
    }
    Ok(BlockConfig { path, mode, id })
}

/// A size in bytes: `N`, or `N` with a `K`, `M` or `G` suffix (KiB, MiB, GiB); at least 1.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let (digits, unit) = match s.char_indices().last() {
        Some((i, 'K' | 'k')) => (&s[..i], 1u64 << 10),
        Some((i, 'M' | 'm')) => (&s[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    let n: u64 = digits
        .parse()
        .map_err(|e| format!("size {s:?}: {e} (expected N, NK, NM or NG)"))?;
    let bytes = n
        .checked_mul(unit)
        .ok_or_else(|| format!("size {s:?} is too large"))?;
    if bytes == 0 {
        return Err(format!("size {s:?}: must be at least 1 byte"));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_specs() {
        let d = parse_disk("/img").unwrap();
        assert_eq!(
            (d.path, d.mode),
            (PathBuf::from("/img"), BlockMode::ReadWrite)
        );
        let d = parse_disk("path=/a,mode=ro,id=root").unwrap();
        assert_eq!((d.mode, d.id.as_str()), (BlockMode::ReadOnly, "root"));
        assert!(parse_disk("path=/a,mode=rx")
            .unwrap_err()
            .contains("expected ro, rw or overlay"));
        let d = parse_disk("path=/o,mode=overlay,base=/b").unwrap();
        assert_eq!(d.mode, BlockMode::Overlay { base: "/b".into() });
        assert!(parse_disk("path=/o,mode=overlay")
            .unwrap_err()
            .contains("base="));
        let n = parse_net("tap=tap0,mac=02:00:00:00:00:01").unwrap();
        assert_eq!(
            (n.tap.as_str(), n.mac.as_deref()),
            ("tap0", Some("02:00:00:00:00:01"))
        );
        assert!(parse_net("mac=x").unwrap_err().contains("tap"));
        let v = parse_vsock("cid=3,uds=/tmp/v.sock").unwrap();
        assert_eq!(v.guest_cid, 3);
        assert!(parse_vsock("cid=x,uds=/a").is_err());
        assert!(parse_disk("mode=ro").unwrap_err().contains("path"));
        assert!(parse_disk("path=/a,colour=red")
            .unwrap_err()
            .contains("colour"));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4M"), Ok(4 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("0").unwrap_err().contains("at least 1"));
        assert!(parse_size("").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("4MB").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999G")
            .unwrap_err()
            .contains("too large"));
    }
}

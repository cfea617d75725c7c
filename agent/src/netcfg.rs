//! The guest's network at boot (`ember.net=ADDR/PREFIX,GATEWAY`): `lo` up, `eth0` up with that
//! IPv4 address, a default route through the gateway and the gateway as the only resolver
//! (`/run/resolv.conf`, which the rootfs's `/etc/resolv.conf` links to).
//!
//! A sandbox template is booted with this once; its clones inherit the configuration from the
//! snapshot (each clone lives in its own network namespace on the host, so every clone can keep
//! the same address). Nothing here runs at restore. Done with the classic `SIOCSIF*` and
//! `SIOCADDRT` ioctls so that the guest needs no `ip` binary.

use std::ffi::CStr;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::str::FromStr;

use thiserror::Error;

/// The guest's interface that `ember.net` configures.
pub const IFACE: &CStr = c"eth0";
/// Where the resolver configuration is written (`/etc/resolv.conf` links here).
pub const RESOLV_CONF: &str = "/run/resolv.conf";

/// TCP settings written when `eth0` is configured.
pub const TCP_TUNING: [(&str, &str); 3] = [
    ("/proc/sys/net/ipv4/tcp_min_tso_segs", "44"),
    ("/proc/sys/net/ipv4/tcp_wmem", "4096 1048576 8388608"),
    ("/proc/sys/net/ipv4/tcp_rmem", "4096 1048576 8388608"),
];

/// What `ember.net` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetSpec {
    /// The guest's address.
    pub addr: Ipv4Addr,
    /// Its prefix length (1..=30).
    pub prefix: u8,
    /// The default gateway, also the resolver.
    pub gateway: Ipv4Addr,
}

impl NetSpec {
    /// The netmask of [`NetSpec::prefix`].
    pub fn netmask(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::MAX << (32 - u32::from(self.prefix)))
    }
}

impl FromStr for NetSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (cidr, gw) = s.split_once(',').ok_or("no gateway")?;
        let (addr, prefix) = cidr.split_once('/').ok_or("no prefix length")?;
        let addr: Ipv4Addr = addr
            .parse()
            .map_err(|_| format!("{addr:?} is not an IPv4 address"))?;
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| (1..=30).contains(p))
            .ok_or_else(|| format!("prefix length {prefix:?} is not 1 to 30"))?;
        let gateway: Ipv4Addr = gw
            .parse()
            .map_err(|_| format!("gateway {gw:?} is not an IPv4 address"))?;
        let spec = NetSpec {
            addr,
            prefix,
            gateway,
        };
        let mask = u32::from(spec.netmask());
        if u32::from(addr) & mask != u32::from(gateway) & mask || addr == gateway {
            return Err(format!(
                "gateway {gateway} is not another address of {cidr}"
            ));
        }
        Ok(spec)
    }
}

/// A step of the configuration that failed.
#[derive(Debug, Error)]
#[error("network set-up: {what} failed: {source}")]
pub struct NetcfgError {
    /// The step.
    pub what: &'static str,
    /// Why.
    #[source]
    pub source: io::Error,
}

fn err(what: &'static str) -> impl FnOnce(io::Error) -> NetcfgError {
    move |source| NetcfgError { what, source }
}

fn sockaddr(ip: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size (16 bytes) on Linux, and every bit
    // pattern is a valid sockaddr.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn ifreq(name: &CStr) -> libc::ifreq {
    // SAFETY: ifreq is plain data (a name array and a union of plain data): all zeroes is valid.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in ifr.ifr_name.iter_mut().zip(name.to_bytes()) {
        *d = *s as libc::c_char;
    }
    ifr
}

fn ioctl(fd: &OwnedFd, req: libc::c_ulong, arg: *mut libc::c_void) -> io::Result<()> {
    // SAFETY: every caller passes a request whose argument is the pointed-to `ifreq` or
    // `rtentry`, which lives across the call.
    if unsafe { libc::ioctl(fd.as_raw_fd(), req, arg) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn set_up(fd: &OwnedFd, name: &CStr) -> io::Result<()> {
    let mut ifr = ifreq(name);
    ioctl(
        fd,
        libc::SIOCGIFFLAGS,
        (&mut ifr as *mut libc::ifreq).cast(),
    )?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    let flags = unsafe { ifr.ifr_ifru.ifru_flags };
    ifr.ifr_ifru.ifru_flags = flags | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    ioctl(
        fd,
        libc::SIOCSIFFLAGS,
        (&mut ifr as *mut libc::ifreq).cast(),
    )
}

/// Brings `lo` up (always: local servers need it) and, with a spec, configures `eth0`, the
/// default route and the resolver.
pub fn configure(spec: Option<&NetSpec>) -> Result<(), NetcfgError> {
    // SAFETY: socket(2) with constant arguments returns a new descriptor or -1.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(err("socket(AF_INET)")(io::Error::last_os_error()));
    }
    // SAFETY: a descriptor the kernel just returned; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    set_up(&fd, c"lo").map_err(err("bringing lo up"))?;
    let Some(spec) = spec else { return Ok(()) };

    let mut ifr = ifreq(IFACE);
    ifr.ifr_ifru.ifru_addr = sockaddr(spec.addr);
    ioctl(
        &fd,
        libc::SIOCSIFADDR,
        (&mut ifr as *mut libc::ifreq).cast(),
    )
    .map_err(err("setting eth0's address"))?;
    let mut ifr = ifreq(IFACE);
    ifr.ifr_ifru.ifru_netmask = sockaddr(spec.netmask());
    ioctl(
        &fd,
        libc::SIOCSIFNETMASK,
        (&mut ifr as *mut libc::ifreq).cast(),
    )
    .map_err(err("setting eth0's netmask"))?;
    set_up(&fd, IFACE).map_err(err("bringing eth0 up"))?;

    // SAFETY: rtentry is plain data (addresses, flags and a nullable pointer): zero is valid.
    let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
    rt.rt_dst = sockaddr(Ipv4Addr::UNSPECIFIED);
    rt.rt_genmask = sockaddr(Ipv4Addr::UNSPECIFIED);
    rt.rt_gateway = sockaddr(spec.gateway);
    rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
    ioctl(&fd, libc::SIOCADDRT, (&mut rt as *mut libc::rtentry).cast())
        .map_err(err("adding the default route"))?;

    // The guest pays per packet (each one is guest-kernel work, slow on kvm_pvm), not per
    // byte: bigger TSO frames and socket buffers (the values tests/devices_guest.rs measured
    // with). Best effort: a kernel without these knobs still has a working network.
    for (knob, value) in TCP_TUNING {
        let _ = std::fs::write(knob, value);
    }
    std::fs::write(
        RESOLV_CONF,
        format!(
            "nameserver {}\noptions timeout:2 attempts:2\n",
            spec.gateway
        ),
    )
    .map_err(err("writing /run/resolv.conf"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_reject_what_cannot_work() {
        let s: NetSpec = "10.0.2.2/30,10.0.2.1".parse().unwrap();
        assert_eq!(s.addr, Ipv4Addr::new(10, 0, 2, 2));
        assert_eq!(s.prefix, 30);
        assert_eq!(s.netmask(), Ipv4Addr::new(255, 255, 255, 252));
        assert_eq!(s.gateway, Ipv4Addr::new(10, 0, 2, 1));
        for bad in [
            "",
            "10.0.2.2",
            "10.0.2.2/30",
            "10.0.2.2,10.0.2.1",
            "10.0.2.2/31,10.0.2.3",
            "10.0.2.2/0,10.0.2.1",
            "10.0.2.300/30,10.0.2.1",
            "10.0.2.2/30,10.0.3.1",
            "10.0.2.2/30,10.0.2.2",
            "10.0.2.2/30,gw",
        ] {
            assert!(bad.parse::<NetSpec>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn addresses_are_in_network_order() {
        let sa = sockaddr(Ipv4Addr::new(192, 0, 2, 1));
        assert_eq!(sa.sa_family, libc::AF_INET as libc::sa_family_t);
        // sin_port (2 bytes) then the address, most significant byte first.
        let bytes: Vec<u8> = sa.sa_data[2..6].iter().map(|b| *b as u8).collect();
        assert_eq!(bytes, [192, 0, 2, 1]);
    }
}

//! virtio-net against real TAP devices.
//!
//! Each test creates its own network namespace (removed again by a guard, also on failure),
//! creates TAPs in it, and runs its body on a thread that entered the namespace: the device
//! opens its TAP from inside, as the VMM does in a sandbox. The test plays the guest driver on
//! rings laid out by virtio-queue's `MockSplitQueue`, and plays "the network" with ordinary
//! sockets bound in the namespace.
//!
//! Needs root, `/dev/net/tun` and iproute2; each test prints a note and passes otherwise.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ember_devices::legacy::EventTrigger;
use ember_devices::virtio::net::{features, Net, NetConfig, NetError, NetState, TapError};
use ember_devices::virtio::{interrupt_cause, Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};
use ember_devices::GuestMemoryMmap;
use ember_snapshot::Persist;
use event_manager::{EventManager, SubscriberOps};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Address, Bytes, GuestAddress};

const HOST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const GUEST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
const GUEST_MAC_STR: &str = "02:00:00:00:00:02";
const HOST_IP: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
const GUEST_IP: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 2);

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const HDR_NEEDS_CSUM: u8 = 1;
const HDR_DATA_VALID: u8 = 2;
const GSO_TCPV4: u8 = 1;

/// Everything the device offers that matters to these tests.
const ALL_OFFLOADS: u64 = features::CSUM
    | features::GUEST_CSUM
    | features::GUEST_TSO4
    | features::GUEST_TSO6
    | features::GUEST_ECN
    | features::HOST_TSO4
    | features::HOST_TSO6
    | features::HOST_ECN;
const BASIC: u64 = VIRTIO_F_VERSION_1 | features::MAC | features::STATUS;

// ---------------------------------------------------------------------------------------------
// Network namespace

fn can_run() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let ok =
        root && Path::new("/dev/net/tun").exists() && Command::new("ip").arg("-V").output().is_ok();
    if !ok {
        eprintln!("skipped: needs root, /dev/net/tun and iproute2");
    }
    ok
}

fn run(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A network namespace, deleted on drop.
struct Netns {
    name: String,
}

/// Deletes namespaces left behind by test processes that were killed (no destructors ran).
fn reap_stale_namespaces() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        let pid = name
            .strip_prefix("ember-nettest-")
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = Command::new("ip").args(["netns", "del", name]).output();
            }
        }
    }
}

impl Netns {
    fn create() -> Self {
        static REAP: std::sync::Once = std::sync::Once::new();
        REAP.call_once(reap_stale_namespaces);
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "ember-nettest-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        );
        run(&["ip", "netns", "add", &name]);
        let ns = Self { name };
        // No IPv6 chatter (router solicitations, DAD) on the TAPs.
        for key in ["all", "default"] {
            ns.exec(&[
                "sysctl",
                "-qw",
                &format!("net.ipv6.conf.{key}.disable_ipv6=1"),
            ]);
        }
        ns
    }

    fn exec(&self, args: &[&str]) {
        let mut full = vec!["ip", "netns", "exec", &self.name];
        full.extend_from_slice(args);
        run(&full);
    }

    fn ip(&self, args: &str) {
        let mut full = vec!["ip", "-n", &self.name];
        full.extend(args.split_whitespace());
        run(&full);
    }

    /// A persistent TAP, up, with the host side's address and a static neighbour entry for the
    /// guest (so the host sends to the guest without ARP).
    fn add_tap(&self, tap: &str, host_mac: [u8; 6], host_ip: Ipv4Addr, guest_ip: Ipv4Addr) {
        self.ip(&format!("tuntap add dev {tap} mode tap"));
        self.ip(&format!("link set dev {tap} address {}", mac_str(host_mac)));
        self.ip(&format!("addr add {host_ip}/24 dev {tap}"));
        self.ip(&format!("link set dev {tap} up"));
        self.ip(&format!(
            "neigh replace {guest_ip} lladdr {GUEST_MAC_STR} dev {tap} nud permanent"
        ));
    }

    /// Moves the calling thread into the namespace.
    fn enter(&self) {
        let f = File::open(format!("/run/netns/{}", self.name)).expect("netns handle");
        // SAFETY: setns on an open namespace fd; it only changes the calling thread's network
        // namespace.
        let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Runs `body` on a thread inside a fresh network namespace; the namespace is removed
/// afterwards whether or not `body` panicked.
/// One TAP test at a time: a test thread forking `ip` while another test holds a TAP gives the
/// child a copy of that TAP's fd until it execs (O_CLOEXEC), and the TAP then reports busy to a
/// test that re-attaches after closing it (seen in CI).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn in_netns(body: impl FnOnce(&Netns) + Send) {
    let _serial = one_at_a_time();
    if !can_run() {
        return;
    }
    let ns = Netns::create();
    let nsr = &ns;
    std::thread::scope(|s| {
        s.spawn(move || {
            nsr.enter();
            body(nsr)
        });
    });
}

fn mac_str(m: [u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

// ---------------------------------------------------------------------------------------------
// The guest driver

/// A completed chain: head, written length, its buffers.
type Used = (u16, u32, Vec<(u64, u32)>);

/// One split virtqueue as the driver sees it.
struct Ring {
    desc: GuestAddress,
    avail: GuestAddress,
    used: GuestAddress,
    size: u16,
    free: Vec<u16>,
    chains: HashMap<u16, Vec<(u64, u32)>>,
    chain_descs: HashMap<u16, Vec<u16>>,
    avail_idx: u16,
    used_seen: u16,
}

impl Ring {
    fn new(mem: &GuestMemoryMmap, start: u64, size: u16) -> (Self, Queue) {
        let mock = MockSplitQueue::create(mem, GuestAddress(start), size);
        let q: Queue = mock.create_queue().unwrap();
        let ring = Self {
            desc: mock.desc_table_addr(),
            avail: mock.avail_addr(),
            used: mock.used_addr(),
            size,
            free: (0..size).rev().collect(),
            chains: HashMap::new(),
            chain_descs: HashMap::new(),
            avail_idx: 0,
            used_seen: 0,
        };
        (ring, q)
    }

    /// Publishes a chain of `(addr, len, flags)` buffers; NEXT links are added here.
    fn add(&mut self, mem: &GuestMemoryMmap, bufs: &[(u64, u32, u16)]) -> u16 {
        let idx: Vec<u16> = (0..bufs.len())
            .map(|_| self.free.pop().expect("ring full"))
            .collect();
        for (i, &(addr, len, flags)) in bufs.iter().enumerate() {
            let (flags, next) = match idx.get(i + 1) {
                Some(&n) => (flags | F_NEXT, n),
                None => (flags, 0),
            };
            let d = RawDescriptor::from(Descriptor::new(addr, len, flags, next));
            mem.write_obj(d, self.desc.unchecked_add(16 * u64::from(idx[i])))
                .unwrap();
        }
        let head = idx[0];
        self.chains
            .insert(head, bufs.iter().map(|&(a, l, _)| (a, l)).collect());
        // Descriptors of a chain may be reused once it completes.
        self.chain_descs.insert(head, idx);
        let slot = u64::from(self.avail_idx % self.size);
        mem.write_obj(head, self.avail.unchecked_add(4 + 2 * slot))
            .unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        std::sync::atomic::fence(Ordering::SeqCst);
        mem.write_obj(self.avail_idx, self.avail.unchecked_add(2))
            .unwrap();
        head
    }

    /// Completed chains since the last call: (head, written length, buffers).
    fn take_used(&mut self, mem: &GuestMemoryMmap) -> Vec<Used> {
        let idx: u16 = mem.read_obj(self.used.unchecked_add(2)).unwrap();
        let mut out = Vec::new();
        while self.used_seen != idx {
            let slot = u64::from(self.used_seen % self.size);
            let id: u32 = mem.read_obj(self.used.unchecked_add(4 + 8 * slot)).unwrap();
            let len: u32 = mem.read_obj(self.used.unchecked_add(8 + 8 * slot)).unwrap();
            let head = id as u16;
            let bufs = self.chains.remove(&head).unwrap_or_default();
            if let Some(idx) = self.chain_descs.remove(&head) {
                self.free.extend(idx);
            }
            out.push((head, len, bufs));
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        out
    }

    /// Pretends the driver published `n` entries without writing them (a hostile avail index).
    fn corrupt_avail_idx(&self, mem: &GuestMemoryMmap, n: u16) {
        mem.write_obj(self.avail_idx.wrapping_add(n), self.avail.unchecked_add(2))
            .unwrap();
    }
}

/// A received frame: its vnet header and the Ethernet frame.
struct RxFrame {
    hdr: [u8; 12],
    data: Vec<u8>,
}

impl RxFrame {
    fn gso_type(&self) -> u8 {
        self.hdr[1]
    }
}

/// The device, its event loop, and a guest driver for it.
struct Rig {
    mem: GuestMemoryMmap,
    net: Arc<Mutex<Net>>,
    em: EventManager<Arc<Mutex<Net>>>,
    irq: Arc<Interrupt>,
    rx: Ring,
    tx: Ring,
    next_buf: u64,
    acked: u64,
    rx_partial: Vec<Used>,
}

const RX_RING: u64 = 0x0;
const TX_RING: u64 = 0x10000;
const MEM_SIZE: usize = 64 << 20;

impl Rig {
    fn new(tap: &str, acked: u64) -> Self {
        let net = Net::new(NetConfig {
            tap: tap.into(),
            mac: Some(GUEST_MAC_STR.into()),
        })
        .expect("attach TAP");
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
        Self::start(net, mem, acked)
    }

    fn start(mut net: Net, mem: GuestMemoryMmap, acked: u64) -> Self {
        let (rx, rxq) = Ring::new(&mem, RX_RING, 256);
        let (tx, txq) = Ring::new(&mem, TX_RING, 256);
        let acked = acked | VIRTIO_F_VERSION_1;
        assert_eq!(acked & !net.avail_features(), 0);
        net.set_acked_features(acked);
        let irq = Arc::new(Interrupt::new(EventTrigger::new().unwrap()));
        net.activate(mem.clone(), irq.clone(), vec![rxq, txq])
            .expect("activate");
        Self::with_device(net, mem, irq, rx, tx, acked)
    }

    fn with_device(
        net: Net,
        mem: GuestMemoryMmap,
        irq: Arc<Interrupt>,
        rx: Ring,
        tx: Ring,
        acked: u64,
    ) -> Self {
        let net = Arc::new(Mutex::new(net));
        let mut em = EventManager::new().unwrap();
        em.add_subscriber(net.clone());
        let mut rig = Self {
            mem,
            net,
            em,
            irq,
            rx,
            tx,
            next_buf: 0x10_0000,
            acked,
            rx_partial: Vec::new(),
        };
        rig.settle();
        rig
    }

    fn dev(&self) -> MutexGuard<'_, Net> {
        self.net.lock().unwrap()
    }

    fn alloc(&mut self, len: u64) -> u64 {
        let a = self.next_buf;
        self.next_buf += len.div_ceil(0x1000) * 0x1000;
        assert!(
            self.next_buf < MEM_SIZE as u64,
            "test ran out of guest memory"
        );
        a
    }

    /// Runs the event loop until nothing happens for 50 ms.
    fn settle(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.em.run_with_timeout(50).unwrap() > 0 {
            assert!(
                Instant::now() < deadline,
                "event loop never went idle (busy loop?)"
            );
        }
    }

    /// Runs the event loop until `cond` holds (or fails after 10 s).
    fn pump_until(&mut self, what: &str, mut cond: impl FnMut(&mut Rig) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond(self) {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; metrics {:?}",
                self.dev().metrics()
            );
            self.em.run_with_timeout(20).unwrap();
        }
    }

    fn kick(&self, queue: usize) {
        self.dev().queue_events()[queue].write(1).unwrap();
    }

    /// Kicks the queue only if the device asked for it (`avail_event` with EVENT_IDX, the
    /// used ring's NO_NOTIFY flag otherwise), as the Linux driver does: a device that forgets
    /// to ask for a kick it waits for hangs these tests.
    fn kick_if_wanted(&self, queue: usize, old: u16) {
        let ring = if queue == 0 { &self.rx } else { &self.tx };
        let new = ring.avail_idx;
        let wanted = if self.acked & features::RING_EVENT_IDX != 0 {
            let event: u16 = self
                .mem
                .read_obj(ring.used.unchecked_add(4 + 8 * u64::from(ring.size)))
                .unwrap();
            new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
        } else {
            let flags: u16 = self.mem.read_obj(ring.used).unwrap();
            flags & 1 == 0
        };
        if wanted {
            self.kick(queue);
        }
    }

    /// Queues one transmit chain (header in its own descriptor, like Linux) and kicks.
    fn send(&mut self, hdr: [u8; 12], frame: &[u8]) {
        let h = self.alloc(12);
        let b = self.alloc(frame.len() as u64);
        self.mem.write_slice(&hdr, GuestAddress(h)).unwrap();
        self.mem.write_slice(frame, GuestAddress(b)).unwrap();
        let old = self.tx.avail_idx;
        self.tx
            .add(&self.mem, &[(h, 12, 0), (b, frame.len() as u32, 0)]);
        self.kick_if_wanted(1, old);
    }

    /// Queues raw transmit chains and kicks once.
    fn send_raw(&mut self, chains: &[&[(u64, u32, u16)]]) {
        let old = self.tx.avail_idx;
        for c in chains {
            self.tx.add(&self.mem, c);
        }
        self.kick_if_wanted(1, old);
    }

    /// Posts `n` receive buffers of `size` bytes and kicks.
    fn post_rx(&mut self, n: usize, size: u32) {
        let old = self.rx.avail_idx;
        for _ in 0..n {
            let a = self.alloc(u64::from(size));
            self.rx.add(&self.mem, &[(a, size, F_WRITE)]);
        }
        self.kick_if_wanted(0, old);
    }

    /// Frames completed on the receive queue so far (merging buffers when negotiated).
    fn received(&mut self) -> Vec<RxFrame> {
        let mut used = std::mem::take(&mut self.rx_partial);
        used.extend(self.rx.take_used(&self.mem));
        let mut out = Vec::new();
        let mut i = 0;
        while i < used.len() {
            let (_, len, bufs) = &used[i];
            let first = self.read_chain(bufs, *len);
            assert!(first.len() >= 12, "short receive completion");
            let mut hdr = [0u8; 12];
            hdr.copy_from_slice(&first[..12]);
            let n = u16::from_le_bytes([hdr[10], hdr[11]]) as usize;
            if self.acked & features::MRG_RXBUF == 0 {
                assert_eq!(n, 1, "num_buffers without MRG_RXBUF");
            }
            if i + n > used.len() {
                // The rest of this frame is not there yet.
                self.rx_partial = used.split_off(i);
                break;
            }
            let mut data = first[12..].to_vec();
            for (_, len, bufs) in &used[i + 1..i + n] {
                data.extend(self.read_chain(bufs, *len));
            }
            out.push(RxFrame { hdr, data });
            i += n;
        }
        out
    }

    fn read_chain(&self, bufs: &[(u64, u32)], mut len: u32) -> Vec<u8> {
        let mut out = Vec::new();
        for &(a, l) in bufs {
            let n = l.min(len);
            let mut v = vec![0u8; n as usize];
            self.mem.read_slice(&mut v, GuestAddress(a)).unwrap();
            out.extend(v);
            len -= n;
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Frames

fn ones_sum(data: &[u8], mut sum: u32) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [b] = chunks.remainder() {
        sum += u32::from(*b) << 8;
    }
    sum
}

fn fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

fn pseudo_sum(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: usize) -> u32 {
    let mut p = Vec::with_capacity(12);
    p.extend(src.octets());
    p.extend(dst.octets());
    p.extend([0, proto]);
    p.extend((len as u16).to_be_bytes());
    ones_sum(&p, 0)
}

struct Ends {
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
}

const GUEST_TO_HOST: Ends = Ends {
    src_mac: GUEST_MAC,
    dst_mac: HOST_MAC,
    src: GUEST_IP,
    dst: HOST_IP,
};

/// Ethernet + IPv4 around `l4` (whose checksum is already set as wanted).
fn ipv4_frame(e: &Ends, proto: u8, l4: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend(e.dst_mac);
    f.extend(e.src_mac);
    f.extend([0x08, 0x00]);
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
    ip[6] = 0x40; // DF
    ip[8] = 64;
    ip[9] = proto;
    ip[12..16].copy_from_slice(&e.src.octets());
    ip[16..20].copy_from_slice(&e.dst.octets());
    let c = !fold(ones_sum(&ip, 0));
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    f.extend(ip);
    f.extend(l4);
    f
}

/// A UDP frame with a complete checksum.
fn udp_frame(e: &Ends, sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let mut u = Vec::new();
    u.extend(sport.to_be_bytes());
    u.extend(dport.to_be_bytes());
    u.extend(((8 + payload.len()) as u16).to_be_bytes());
    u.extend([0, 0]);
    u.extend(payload);
    let c = !fold(ones_sum(&u, pseudo_sum(e.src, e.dst, 17, u.len())));
    u[6..8].copy_from_slice(&c.to_be_bytes());
    ipv4_frame(e, 17, &u)
}

const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_PSH: u8 = 0x08;
const TCP_ACK: u8 = 0x10;

/// A TCP segment whose checksum is left to the device (`NEEDS_CSUM`): the field holds the
/// pseudo-header sum, as Linux does for checksum offload.
/// TCP header fields the tests vary.
struct Seg {
    sport: u16,
    dport: u16,
    seq: u32,
    ack: u32,
    flags: u8,
}

fn tcp_frame_partial(e: &Ends, g: Seg, opts: &[u8], payload: &[u8]) -> Vec<u8> {
    let hl = 20 + opts.len();
    let mut t = Vec::new();
    t.extend(g.sport.to_be_bytes());
    t.extend(g.dport.to_be_bytes());
    t.extend(g.seq.to_be_bytes());
    t.extend(g.ack.to_be_bytes());
    t.push(((hl / 4) as u8) << 4);
    t.push(g.flags);
    t.extend(65535u16.to_be_bytes());
    t.extend([0, 0, 0, 0]);
    t.extend(opts);
    t.extend(payload);
    let c = fold(pseudo_sum(e.src, e.dst, 6, t.len()));
    t[16..18].copy_from_slice(&c.to_be_bytes());
    ipv4_frame(e, 6, &t)
}

fn csum_hdr(csum_start: u16, csum_offset: u16) -> [u8; 12] {
    let mut h = [0u8; 12];
    h[0] = HDR_NEEDS_CSUM;
    h[6..8].copy_from_slice(&csum_start.to_le_bytes());
    h[8..10].copy_from_slice(&csum_offset.to_le_bytes());
    h
}

/// A parsed IPv4 frame addressed to the guest.
struct Parsed {
    proto: u8,
    src: Ipv4Addr,
    sport: u16,
    dport: u16,
    l4: Vec<u8>,
}

impl Parsed {
    fn new(f: &[u8]) -> Option<Self> {
        if f.len() < 34 || f[12..14] != [0x08, 0x00] || f[..6] != GUEST_MAC {
            return None;
        }
        let ihl = usize::from(f[14] & 0xf) * 4;
        let tot = usize::from(u16::from_be_bytes([f[16], f[17]]));
        let l4 = f.get(14 + ihl..14 + tot)?.to_vec();
        if l4.len() < 8 {
            return None;
        }
        Some(Self {
            proto: f[23],
            src: Ipv4Addr::new(f[26], f[27], f[28], f[29]),
            sport: u16::from_be_bytes([l4[0], l4[1]]),
            dport: u16::from_be_bytes([l4[2], l4[3]]),
            l4,
        })
    }

    fn udp_payload(&self) -> &[u8] {
        &self.l4[8..]
    }

    fn udp_checksum_ok(&self, dst: Ipv4Addr) -> bool {
        fold(ones_sum(
            &self.l4,
            pseudo_sum(self.src, dst, 17, self.l4.len()),
        )) == 0xffff
    }

    fn tcp_flags(&self) -> u8 {
        self.l4[13]
    }

    fn tcp_seq(&self) -> u32 {
        u32::from_be_bytes([self.l4[4], self.l4[5], self.l4[6], self.l4[7]])
    }

    fn tcp_payload(&self) -> &[u8] {
        let off = usize::from(self.l4[12] >> 4) * 4;
        &self.l4[off.min(self.l4.len())..]
    }
}

fn udp_socket(ip: Ipv4Addr, port: u16) -> UdpSocket {
    let s = UdpSocket::bind(SocketAddrV4::new(ip, port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn attach_errors_are_clear() {
    in_netns(|ns| {
        let open = |tap: &str| {
            Net::new(NetConfig {
                tap: tap.into(),
                mac: None,
            })
        };
        let e = open("nosuchtap0").unwrap_err();
        assert!(matches!(e, NetError::Tap(TapError::NotFound { .. })), "{e}");
        assert!(e.to_string().contains("nosuchtap0"), "{e}");

        ns.ip("tuntap add dev tun0 mode tun");
        let e = open("tun0").unwrap_err();
        assert!(
            matches!(e, NetError::Tap(TapError::WrongType { .. })),
            "{e}"
        );
        assert!(e.to_string().contains("tun0"), "{e}");

        let e = open("lo").unwrap_err();
        assert!(
            matches!(e, NetError::Tap(TapError::WrongType { .. })),
            "{e}"
        );

        ns.ip("tuntap add dev tap0 mode tap");
        let first = open("tap0").expect("first attach");
        let e = open("tap0").unwrap_err();
        assert!(matches!(e, NetError::Tap(TapError::Busy { .. })), "{e}");
        assert!(e.to_string().contains("tap0"), "{e}");
        drop(first);
        open("tap0").expect("attach again after the first user left");

        let e = Net::new(NetConfig {
            tap: "tap0".into(),
            mac: Some("01:00:5e:00:00:01".into()),
        })
        .unwrap_err();
        assert!(matches!(e, NetError::Mac { .. }), "{e}");
        let e = Net::new(NetConfig {
            tap: "tap0".into(),
            mac: Some("02:00:00:00:00".into()),
        })
        .unwrap_err();
        assert!(e.to_string().contains("02:00:00:00:00"), "{e}");
    });
}

#[test]
fn the_tap_is_only_visible_inside_its_namespace() {
    let _serial = one_at_a_time();
    if !can_run() {
        return;
    }
    let ns = Netns::create();
    ns.ip("tuntap add dev embnstap0 mode tap");
    // From the test's own namespace the TAP does not exist...
    let e = Net::new(NetConfig {
        tap: "embnstap0".into(),
        mac: None,
    })
    .unwrap_err();
    assert!(matches!(e, NetError::Tap(TapError::NotFound { .. })), "{e}");
    // ...from inside it does, and the device reports its configuration.
    std::thread::scope(|s| {
        s.spawn(|| {
            ns.enter();
            let net = Net::new(NetConfig {
                tap: "embnstap0".into(),
                mac: None,
            })
            .unwrap();
            assert_eq!(net.tap_name(), "embnstap0");
            assert!(net.mac().is_locally_administered());
            let mut cfg = [0u8; 8];
            net.read_config(0, &mut cfg);
            assert_eq!(cfg[..6], net.mac().bytes());
            assert_eq!(u16::from_le_bytes([cfg[6], cfg[7]]), 1, "link up");
            assert_eq!(net.device_type(), 1);
            assert_eq!(net.queue_max_sizes().len(), 2);
        });
    });
}

#[test]
fn udp_both_ways_without_offloads() {
    in_netns(|ns| {
        ns.add_tap("tap0", HOST_MAC, HOST_IP, GUEST_IP);
        let mut rig = Rig::new("tap0", BASIC);
        let sock = udp_socket(HOST_IP, 5555);

        // Guest → host.
        rig.send(
            [0; 12],
            &udp_frame(&GUEST_TO_HOST, 4444, 5555, b"hello from the guest"),
        );
        rig.pump_until("the frame to reach the TAP", |r| {
            r.dev().metrics().tx_frames == 1
        });
        let mut buf = [0u8; 100];
        let (n, from) = sock.recv_from(&mut buf).expect("datagram from the guest");
        assert_eq!(&buf[..n], b"hello from the guest");
        assert_eq!(from, SocketAddrV4::new(GUEST_IP, 4444).into());
        let used = rig.tx.take_used(&rig.mem);
        assert_eq!(used.len(), 1);
        assert_eq!(used[0].1, 0, "transmit completions carry no length");
        assert_ne!(rig.irq.status() & interrupt_cause::VRING, 0);

        // Host → guest: a full checksum and no offload flags, since the guest took none.
        rig.post_rx(4, 1526 + 12);
        sock.send_to(b"hello from the host", SocketAddrV4::new(GUEST_IP, 4444))
            .unwrap();
        rig.pump_until("a frame for the guest", |r| {
            r.dev().metrics().rx_frames >= 1
        });
        let frames = rig.received();
        let f = frames
            .iter()
            .find_map(|f| {
                Parsed::new(&f.data)
                    .filter(|p| p.proto == 17)
                    .map(|p| (f, p))
            })
            .expect("the UDP frame");
        assert_eq!(f.1.udp_payload(), b"hello from the host");
        assert_eq!((f.1.sport, f.1.dport), (5555, 4444));
        assert_eq!(f.0.hdr[0], 0, "no checksum flags without GUEST_CSUM");
        assert_eq!(f.0.gso_type(), 0);
        assert!(
            f.1.udp_checksum_ok(GUEST_IP),
            "the host completed the checksum"
        );
        let m = rig.dev().metrics();
        assert_eq!((m.tx_malformed, m.rx_malformed, m.rx_dropped), (0, 0, 0));
    });
}

#[test]
fn udp_with_checksum_offload() {
    in_netns(|ns| {
        ns.add_tap("tap0", HOST_MAC, HOST_IP, GUEST_IP);
        let mut rig = Rig::new("tap0", BASIC | ALL_OFFLOADS | features::MRG_RXBUF);
        let sock = udp_socket(HOST_IP, 5555);

        // The guest leaves the UDP checksum to the device.
        let payload = b"partial checksum";
        let mut f = udp_frame(&GUEST_TO_HOST, 4444, 5555, payload);
        let pseudo = fold(pseudo_sum(GUEST_IP, HOST_IP, 17, 8 + payload.len()));
        f[40..42].copy_from_slice(&pseudo.to_be_bytes());
        rig.send(csum_hdr(34, 6), &f);
        rig.pump_until("the frame to reach the TAP", |r| {
            r.dev().metrics().tx_frames == 1
        });
        let mut buf = [0u8; 100];
        let (n, _) = sock.recv_from(&mut buf).expect("datagram from the guest");
        assert_eq!(&buf[..n], payload);

        // The host leaves its checksum to the guest (or marks it verified).
        rig.post_rx(8, 4096);
        sock.send_to(b"offloaded", SocketAddrV4::new(GUEST_IP, 4444))
            .unwrap();
        rig.pump_until("a frame for the guest", |r| {
            r.dev().metrics().rx_frames >= 1
        });
        let frames = rig.received();
        let f = frames
            .iter()
            .find(|f| Parsed::new(&f.data).is_some_and(|p| p.proto == 17))
            .expect("the UDP frame");
        assert_eq!(Parsed::new(&f.data).unwrap().udp_payload(), b"offloaded");
        assert_ne!(
            f.hdr[0] & (HDR_NEEDS_CSUM | HDR_DATA_VALID),
            0,
            "{:?}",
            f.hdr
        );
    });
}

#[test]
fn frames_wait_for_receive_buffers() {
    in_netns(|ns| {
        ns.add_tap("tap0", HOST_MAC, HOST_IP, GUEST_IP);
        let mut rig = Rig::new("tap0", BASIC);
        let sock = udp_socket(HOST_IP, 5555);
        for i in 0..5u8 {
            sock.send_to(&[i; 100], SocketAddrV4::new(GUEST_IP, 4444))
                .unwrap();
        }
        // No buffers: one frame is held, the TAP is left alone, and the loop goes idle.
        rig.pump_until("the device to notice the frames", |r| r.dev().rx_pending());
        rig.settle();
        for _ in 0..5 {
            assert_eq!(
                rig.em.run_with_timeout(20).unwrap(),
                0,
                "no busy loop while starved"
            );
        }
        let m = rig.dev().metrics();
        assert_eq!((m.rx_frames, m.rx_dropped), (0, 0));
        assert!(m.rx_stalls >= 1);

        // Two buffers: two frames, then starved again.
        rig.post_rx(2, 1526 + 12);
        rig.pump_until("two frames", |r| r.dev().metrics().rx_frames == 2);
        rig.settle();
        assert!(rig.dev().rx_pending());
        // The rest, in order.
        rig.post_rx(8, 1526 + 12);
        rig.pump_until("all frames", |r| r.dev().metrics().rx_frames == 5);
        let got: Vec<u8> = rig
            .received()
            .iter()
            .filter_map(|f| Parsed::new(&f.data))
            .filter(|p| p.proto == 17)
            .map(|p| p.udp_payload()[0])
            .collect();
        assert_eq!(got, vec![0, 1, 2, 3, 4]);
        assert!(!rig.dev().rx_pending());
        assert_eq!(rig.dev().metrics().rx_dropped, 0);
    });
}

#[test]
fn mergeable_buffers_wait_until_the_frame_fits() {
    in_netns(|ns| {
        ns.add_tap("tap0", HOST_MAC, HOST_IP, GUEST_IP);
        let mut rig = Rig::new(
            "tap0",
            BASIC | features::MRG_RXBUF | features::RING_EVENT_IDX,
        );
        let sock = udp_socket(HOST_IP, 5555);
        ns.ip("link set dev tap0 mtu 9000");
        // A 5000-byte datagram needs 3 buffers of 2048 bytes; offer 2 first.
        rig.post_rx(2, 2048);
        rig.settle();
        let big: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        sock.send_to(&big, SocketAddrV4::new(GUEST_IP, 4444))
            .unwrap();
        rig.pump_until("the frame to be held", |r| r.dev().rx_pending());
        rig.settle();
        assert_eq!(rig.dev().metrics().rx_frames, 0);
        assert!(
            rig.rx.take_used(&rig.mem).is_empty(),
            "nothing consumed while short"
        );
        rig.post_rx(1, 2048);
        rig.pump_until("the frame", |r| r.dev().metrics().rx_frames == 1);
        let frames = rig.received();
        assert_eq!(frames.len(), 1);
        assert_eq!(
            u16::from_le_bytes([frames[0].hdr[10], frames[0].hdr[11]]),
            3
        );
        assert_eq!(
            Parsed::new(&frames[0].data).unwrap().udp_payload(),
            &big[..]
        );
    });
}

#[test]
fn tcp_with_segmentation_offloads_both_ways() {
    in_netns(|ns| {
        ns.add_tap("tap0", HOST_MAC, HOST_IP, GUEST_IP);
        let features = BASIC | ALL_OFFLOADS | features::MRG_RXBUF | features::RING_EVENT_IDX;
        let mut rig = Rig::new("tap0", features);
        let listener = TcpListener::bind(SocketAddrV4::new(HOST_IP, 7000)).unwrap();
        rig.post_rx(128, 4096);

        // Handshake, with checksums left to the device.
        let isn = 1000u32;
        let mss = [2, 4, 0x05, 0xb4]; // MSS 1460
        let seg = |seq, ack, flags| Seg {
            sport: 40000,
            dport: 7000,
            seq,
            ack,
            flags,
        };
        let syn = tcp_frame_partial(&GUEST_TO_HOST, seg(isn, 0, TCP_SYN), &mss, &[]);
        rig.send(csum_hdr(34, 16), &syn);
        let mut synack = None;
        rig.pump_until("SYN-ACK", |r| {
            for f in r.received() {
                if let Some(p) = Parsed::new(&f.data) {
                    if p.proto == 6 && p.tcp_flags() & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK {
                        synack = Some(p.tcp_seq());
                    }
                }
            }
            synack.is_some()
        });
        let server_isn = synack.unwrap();

        // One 4000-byte TSO frame from the guest, completing the handshake.
        let data: Vec<u8> = (0..4000u32).map(|i| (i * 7 % 256) as u8).collect();
        let seg = tcp_frame_partial(
            &GUEST_TO_HOST,
            seg(isn + 1, server_isn + 1, TCP_ACK | TCP_PSH),
            &[],
            &data,
        );
        let mut hdr = csum_hdr(34, 16);
        hdr[1] = GSO_TCPV4;
        hdr[2..4].copy_from_slice(&54u16.to_le_bytes());
        hdr[4..6].copy_from_slice(&1460u16.to_le_bytes());
        rig.send(hdr, &seg);
        rig.pump_until("the TSO frame to reach the TAP", |r| {
            r.dev().metrics().tx_frames == 2
        });
        assert_eq!(rig.dev().metrics().tx_errors, 0);
        listener.set_nonblocking(false).unwrap();
        let (mut conn, peer) = listener.accept().unwrap();
        assert_eq!(peer, SocketAddrV4::new(GUEST_IP, 40000).into());
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = vec![0u8; data.len()];
        conn.read_exact(&mut got).expect("the guest's data");
        assert_eq!(got, data);

        // The host answers with more than one MSS at once: with GUEST_TSO4 the TAP hands over
        // GSO frames, spread over several mergeable buffers.
        let reply: Vec<u8> = (0..12000u32).map(|i| (i * 13 % 256) as u8).collect();
        conn.write_all(&reply).unwrap();
        let mut stream = Vec::new();
        let mut gso_seen = false;
        rig.pump_until("the host's data", |r| {
            for f in r.received() {
                let Some(p) = Parsed::new(&f.data) else {
                    continue;
                };
                if p.proto != 6 || p.tcp_flags() & TCP_RST != 0 {
                    continue;
                }
                let off = p.tcp_seq().wrapping_sub(server_isn + 1) as usize;
                let pl = p.tcp_payload();
                if off == stream.len() && !pl.is_empty() {
                    stream.extend_from_slice(pl);
                    if f.gso_type() == GSO_TCPV4 && f.data.len() > 1514 {
                        gso_seen = true;
                    }
                }
            }
            stream.len() >= 2 * 1460
        });
        assert_eq!(stream[..], reply[..stream.len()]);
        assert!(gso_seen, "expected a GSO frame from the TAP");
        let m = rig.dev().metrics();
        assert_eq!((m.tx_malformed, m.rx_malformed, m.rx_dropped), (0, 0, 0));
    });
}

#[test]
fn hostile_chains_are_completed_and_counted() {
    in_netns(|ns| {
        ns.add_tap("tap0", HOST_MAC, HOST_IP, GUEST_IP);
        let mut rig = Rig::new("tap0", BASIC);
        let sock = udp_socket(HOST_IP, 5555);
        let good = udp_frame(&GUEST_TO_HOST, 4444, 5555, b"still alive");
        let buf = rig.alloc(0x20000);
        rig.mem.write_slice(&[0u8; 12], GuestAddress(buf)).unwrap();
        rig.mem.write_slice(&good, GuestAddress(buf + 12)).unwrap();
        let len = 12 + good.len() as u32;
        // Offload the guest did not negotiate.
        let csum = rig.alloc(0x1000);
        rig.mem
            .write_slice(&csum_hdr(34, 6), GuestAddress(csum))
            .unwrap();
        rig.mem.write_slice(&good, GuestAddress(csum + 12)).unwrap();
        rig.send_raw(&[
            &[(buf, len, 0), (buf, 10, F_WRITE)], // writable descriptor
            &[(0xffff_0000_0000, len, 0)],        // outside guest memory
            &[(buf, 12 + 0x10000 + 100, 0)],      // larger than any frame
            &[(buf, 8, 0)],                       // shorter than a header
            &[(buf, 12, 0), (buf, 0, 0)],         // no Ethernet header
            &[(csum, len, 0)],                    // NEEDS_CSUM without CSUM
            &[(buf, len, 0)],                     // fine
        ]);
        rig.pump_until("all chains", |r| {
            let m = r.dev().metrics();
            m.tx_frames + m.tx_malformed == 7
        });
        assert!(rig.tx.take_used(&rig.mem).iter().all(|u| u.1 == 0));
        rig.settle();
        let m = rig.dev().metrics();
        assert_eq!((m.tx_malformed, m.tx_frames), (6, 1), "{m:?}");
        let mut b = [0u8; 64];
        let (n, _) = sock.recv_from(&mut b).unwrap();
        assert_eq!(&b[..n], b"still alive");

        // Receive chains: read-only and outside memory are refused, the next one is used.
        let ro = rig.alloc(4096);
        rig.rx.add(&rig.mem, &[(ro, 4096, 0)]);
        rig.rx.add(&rig.mem, &[(0xffff_0000_0000, 4096, F_WRITE)]);
        rig.post_rx(1, 1538);
        sock.send_to(b"to the guest", SocketAddrV4::new(GUEST_IP, 4444))
            .unwrap();
        rig.pump_until("the frame", |r| r.dev().metrics().rx_frames == 1);
        let used = rig.rx.take_used(&rig.mem);
        assert_eq!(used.len(), 3);
        assert_eq!((used[0].1, used[1].1), (0, 0));
        assert!(used[2].1 > 12 + 42);
        assert_eq!(rig.dev().metrics().rx_malformed, 2);

        // A driver publishing more entries than the ring holds breaks the queue: the device
        // asks for a reset instead of looping or panicking, and a reset brings it back.
        rig.tx.corrupt_avail_idx(&rig.mem, 1000);
        rig.irq.ack(u32::MAX);
        rig.kick(1);
        rig.settle();
        assert_ne!(rig.irq.status() & interrupt_cause::CONFIG, 0);
        let mut net = rig.dev();
        net.reset();
        assert!(!net.is_activated());
    });
}

#[test]
fn transmit_to_a_down_tap_is_counted_not_fatal() {
    in_netns(|ns| {
        ns.add_tap("tap0", HOST_MAC, HOST_IP, GUEST_IP);
        let mut rig = Rig::new("tap0", BASIC);
        ns.ip("link set dev tap0 down");
        rig.send([0; 12], &udp_frame(&GUEST_TO_HOST, 1, 2, b"x"));
        rig.pump_until("the completion", |r| r.dev().metrics().tx_errors == 1);
        assert_eq!(rig.tx.take_used(&rig.mem).len(), 1);
    });
}

#[test]
fn a_deleted_tap_does_not_spin_the_loop() {
    in_netns(|ns| {
        ns.add_tap("tap0", HOST_MAC, HOST_IP, GUEST_IP);
        let mut rig = Rig::new("tap0", BASIC);
        rig.post_rx(4, 1538);
        ns.ip("link del dev tap0");
        rig.pump_until("the TAP error", |r| r.dev().metrics().tap_errors >= 1);
        rig.settle();
        for _ in 0..3 {
            assert_eq!(rig.em.run_with_timeout(20).unwrap(), 0);
        }
    });
}

#[test]
fn snapshot_and_restore_onto_another_tap() {
    in_netns(|ns| {
        ns.add_tap("tap0", HOST_MAC, HOST_IP, GUEST_IP);
        let features = BASIC | ALL_OFFLOADS | features::MRG_RXBUF | features::RING_EVENT_IDX;
        let mut rig = Rig::new("tap0", features);
        let sock = udp_socket(HOST_IP, 5555);
        rig.send([0; 12], &udp_frame(&GUEST_TO_HOST, 4444, 5555, b"before"));
        rig.pump_until("first frame", |r| r.dev().metrics().tx_frames == 1);
        let mut b = [0u8; 64];
        let (n, _) = sock.recv_from(&mut b).unwrap();
        assert_eq!(&b[..n], b"before");
        rig.post_rx(4, 4096);

        let state = rig.dev().save();
        assert!(state.activated);
        assert_eq!(state.mac, GUEST_MAC);
        assert_eq!(state.acked_features, features | VIRTIO_F_VERSION_1);
        assert_eq!(state.queues.len(), 2);
        assert_eq!(state.queues[1].next_avail, 1);
        let bytes = ember_snapshot::encode_state(&state).unwrap();
        let state: NetState = ember_snapshot::decode_state(&bytes).unwrap();

        // The clone gets its own TAP (same guest addresses, a different host side).
        let clone_host_mac = [0x02, 0, 0, 0, 1, 1];
        ns.ip("link set dev tap0 down");
        ns.ip("addr flush dev tap0");
        ns.add_tap("tap1", clone_host_mac, HOST_IP, GUEST_IP);
        let Rig {
            mem, irq, rx, tx, ..
        } = rig;
        let cfg = NetConfig {
            tap: "tap1".into(),
            mac: None,
        };

        // Refusals first.
        let err = |r: Result<Net, NetError>| r.map(|_| ()).unwrap_err().to_string();
        let e = err(Net::restore((cfg.clone(), None), &state));
        assert!(e.contains("tap1") && e.contains("memory"), "{e}");
        let mut bad = state.clone();
        bad.mac = [0xff; 6];
        assert!(err(Net::restore(
            (cfg.clone(), Some((mem.clone(), irq.clone()))),
            &bad
        ))
        .contains("multicast"));
        let mut bad = state.clone();
        bad.queues[0].used_ring = MEM_SIZE as u64 + 0x1000;
        assert!(Net::restore((cfg.clone(), Some((mem.clone(), irq.clone()))), &bad).is_err());
        let mut bad = state.clone();
        bad.queues.pop();
        assert!(Net::restore((cfg.clone(), Some((mem.clone(), irq.clone()))), &bad).is_err());
        let mut bad = state.clone();
        bad.acked_features |= 1 << 22; // VIRTIO_NET_F_MQ: never offered
        assert!(Net::restore((cfg.clone(), Some((mem.clone(), irq.clone()))), &bad).is_err());
        let other_mac = NetConfig {
            tap: "tap1".into(),
            mac: Some("02:00:00:00:00:99".into()),
        };
        let e = err(Net::restore(
            (other_mac, Some((mem.clone(), irq.clone()))),
            &state,
        ));
        assert!(e.contains("MAC"), "{e}");
        let missing = NetConfig {
            tap: "tap9".into(),
            mac: None,
        };
        assert!(matches!(
            Net::restore((missing, Some((mem.clone(), irq.clone()))), &state),
            Err(NetError::Tap(TapError::NotFound { .. }))
        ));

        // The real restore continues where the queues left off.
        let net = Net::restore((cfg, Some((mem.clone(), irq.clone()))), &state).unwrap();
        assert!(net.is_activated());
        assert_eq!(net.mac().bytes(), GUEST_MAC);
        assert_eq!(net.save(), state);
        let mut rig = Rig::with_device(net, mem, irq, rx, tx, features | VIRTIO_F_VERSION_1);
        let mut f = udp_frame(&GUEST_TO_HOST, 4444, 5555, b"after");
        f[..6].copy_from_slice(&clone_host_mac);
        rig.send([0; 12], &f);
        rig.pump_until("frame after restore", |r| r.dev().metrics().tx_frames == 1);
        let (n, _) = sock.recv_from(&mut b).unwrap();
        assert_eq!(&b[..n], b"after");
        // Receive works with the buffers posted before the snapshot.
        sock.send_to(b"welcome back", SocketAddrV4::new(GUEST_IP, 4444))
            .unwrap();
        rig.pump_until("a frame for the restored guest", |r| {
            r.dev().metrics().rx_frames >= 1
        });
        let frames = rig.received();
        assert!(frames
            .iter()
            .filter_map(|f| Parsed::new(&f.data))
            .any(|p| p.proto == 17 && p.udp_payload() == b"welcome back"));

        // A device that was never started restores without memory.
        let idle = NetState {
            mac: GUEST_MAC,
            acked_features: 0,
            activated: false,
            queues: vec![],
        };
        drop(rig);
        let net = Net::restore(
            (
                NetConfig {
                    tap: "tap1".into(),
                    mac: None,
                },
                None,
            ),
            &idle,
        )
        .unwrap();
        assert!(!net.is_activated());
    });
}

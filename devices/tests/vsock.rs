//! virtio-vsock end to end on the host: the device runs on a real `EventManager` with real Unix
//! sockets, and the guest driver is played by this file through split virtqueues in guest
//! memory (a small driver here, so that rings of 256 entries can fill up and wrap around).

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ember_devices::legacy::EventTrigger;
use ember_devices::virtio::vsock::packet::{op, shutdown, Header, HDR_LEN, TYPE_STREAM};
use ember_devices::virtio::vsock::{Vsock, VsockConfig, VsockState, CONN_BUF_ALLOC};
use ember_devices::virtio::{Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};
use ember_devices::GuestMemoryMmap;
use ember_snapshot::Persist;
use event_manager::{EventManager, SubscriberOps};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

const CID: u64 = 3;
const QSIZE: u16 = 256;
const SLOT: u64 = 0x1_0000;
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const MEM_SIZE: u64 = 0x400_0000;
const RX_BUF: u32 = 4096;

// ---------------------------------------------------------------------------------------------
// The guest's side of one split virtqueue.

struct Ring {
    desc: u64,
    avail: u64,
    used: u64,
    data: u64,
    free: Vec<u16>,
    avail_idx: u16,
    last_used: u16,
    chains: HashMap<u16, Vec<u16>>,
}

impl Ring {
    /// Rings at `base` (descriptors), `base + 4 KiB` (available), `base + 8 KiB` (used).
    /// (virtio-queue's `MockSplitQueue` is not used for the layout: it sizes rings by element
    /// count rather than bytes, so with 256 entries its used ring overlaps the available ring.)
    fn new(mem: &GuestMemoryMmap, base: u64, data: u64) -> (Self, Queue) {
        let (desc, avail, used) = (base, base + 0x1000, base + 0x2000);
        for a in [avail, used] {
            mem.write_slice(&[0u8; 0x1000], GuestAddress(a)).unwrap();
        }
        let mut q = Queue::new(QSIZE).unwrap();
        q.set_size(QSIZE);
        q.set_desc_table_address(Some(desc as u32), Some((desc >> 32) as u32));
        q.set_avail_ring_address(Some(avail as u32), Some((avail >> 32) as u32));
        q.set_used_ring_address(Some(used as u32), Some((used >> 32) as u32));
        q.set_ready(true);
        assert!(q.is_valid(mem));
        let ring = Self {
            desc,
            avail,
            used,
            data,
            free: (0..QSIZE).rev().collect(),
            avail_idx: 0,
            last_used: 0,
            chains: HashMap::new(),
        };
        (ring, q)
    }

    fn slot(&self, i: u16) -> u64 {
        self.data + u64::from(i) * SLOT
    }

    fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Publishes a chain of descriptors, `(addr or None for the slot, len, flags)`.
    fn add(&mut self, mem: &GuestMemoryMmap, parts: &[(Option<u64>, u32, u16)]) -> Option<u16> {
        if self.free.len() < parts.len() || parts.is_empty() {
            return None;
        }
        let idxs: Vec<u16> = (0..parts.len()).map(|_| self.free.pop().unwrap()).collect();
        for (k, (&i, &(addr, len, flags))) in idxs.iter().zip(parts).enumerate() {
            let next = idxs.get(k + 1).copied();
            let f = flags | if next.is_some() { F_NEXT } else { 0 };
            let a = GuestAddress(self.desc + 16 * u64::from(i));
            mem.write_obj(addr.unwrap_or(self.slot(i)), a).unwrap();
            mem.write_obj(len, GuestAddress(a.0 + 8)).unwrap();
            mem.write_obj(f, GuestAddress(a.0 + 12)).unwrap();
            mem.write_obj(next.unwrap_or(0), GuestAddress(a.0 + 14))
                .unwrap();
        }
        let head = idxs[0];
        self.chains.insert(head, idxs);
        let pos = self.avail + 4 + 2 * u64::from(self.avail_idx % QSIZE);
        mem.write_obj(head, GuestAddress(pos)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        mem.write_obj(self.avail_idx, GuestAddress(self.avail + 2))
            .unwrap();
        Some(head)
    }

    /// The next used chain: its descriptor indices and the used length.
    fn pop_used(&mut self, mem: &GuestMemoryMmap) -> Option<(Vec<u16>, u32)> {
        let idx: u16 = mem.read_obj(GuestAddress(self.used + 2)).unwrap();
        if idx == self.last_used {
            return None;
        }
        let e = self.used + 4 + 8 * u64::from(self.last_used % QSIZE);
        let id: u32 = mem.read_obj(GuestAddress(e)).unwrap();
        let len: u32 = mem.read_obj(GuestAddress(e + 4)).unwrap();
        self.last_used = self.last_used.wrapping_add(1);
        let Some(idxs) = self.chains.remove(&(id as u16)) else {
            panic!(
                "device used unknown chain {id} (len {len}) at used {} of ring at {:#x}",
                self.last_used.wrapping_sub(1),
                self.desc
            );
        };
        self.free.extend(idxs.iter().copied());
        Some((idxs, len))
    }
}

// ---------------------------------------------------------------------------------------------
// A tiny guest vsock stack.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum GState {
    #[default]
    Connecting,
    Connected,
    Reset,
}

#[derive(Debug, Default)]
struct GSock {
    state: GState,
    data: Vec<u8>,
    buf_alloc: u32,
    fwd_cnt: u32,
    last_fwd_sent: u32,
    /// The guest application reads as data arrives (and credit goes back).
    consume: bool,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    tx_cnt: u32,
    peer_shutdown: u32,
    out: VecDeque<u8>,
    credit_requests: usize,
}

impl GSock {
    fn credit(&self) -> u32 {
        self.peer_buf_alloc
            .saturating_sub(self.tx_cnt.wrapping_sub(self.peer_fwd_cnt))
    }
}

type Key = (u32, u32); // (guest port, host port)

struct Guest {
    mem: GuestMemoryMmap,
    rx: Ring,
    tx: Ring,
    ev: Ring,
    kicks: [EventFd; 3],
    rx_two_desc: bool,
    repost_rx: bool,
    socks: HashMap<Key, GSock>,
    incoming: Vec<Header>,
    log: Vec<Header>,
    events: Vec<u32>,
    /// Re-post each consumed event buffer (what the Linux driver does).
    repost_events: bool,
    pending_tx: VecDeque<(Header, Vec<u8>)>,
    unusable_rx: usize,
}

impl Guest {
    fn hdr(&self, key: Key, op: u16) -> Header {
        let s = self.socks.get(&key);
        Header {
            src_cid: CID,
            dst_cid: 2,
            src_port: key.0,
            dst_port: key.1,
            kind: TYPE_STREAM,
            op,
            buf_alloc: s.map_or(256 * 1024, |s| s.buf_alloc),
            fwd_cnt: s.map_or(0, |s| s.fwd_cnt),
            ..Header::default()
        }
    }

    fn post_rx(&mut self, n: usize) {
        for _ in 0..n {
            let ok = if self.rx_two_desc {
                self.rx.add(
                    &self.mem,
                    &[(None, HDR_LEN as u32, F_WRITE), (None, RX_BUF, F_WRITE)],
                )
            } else {
                self.rx
                    .add(&self.mem, &[(None, HDR_LEN as u32 + RX_BUF, F_WRITE)])
            };
            if ok.is_none() {
                break;
            }
        }
        self.kicks[0].write(1).unwrap();
    }

    fn post_events(&mut self, n: usize) {
        for _ in 0..n {
            self.ev.add(&self.mem, &[(None, 4, F_WRITE)]);
        }
        self.kicks[2].write(1).unwrap();
    }

    /// Queues a packet exactly as given.
    fn send_raw(&mut self, h: Header, payload: &[u8]) {
        self.pending_tx.push_back((h, payload.to_vec()));
        self.flush_tx();
    }

    fn flush_tx(&mut self) -> bool {
        let mut sent = false;
        while let Some((h, p)) = self.pending_tx.front() {
            if self.tx.free_count() < 2 {
                break;
            }
            let mut parts = vec![(None, HDR_LEN as u32, 0)];
            if !p.is_empty() {
                parts.push((None, p.len() as u32, 0));
            }
            // Fill the slots before publishing (the slots of the next free descriptors).
            let n = self.tx.free.len();
            let hdr_slot = self.tx.slot(self.tx.free[n - 1]);
            self.mem
                .write_slice(&h.to_bytes(), GuestAddress(hdr_slot))
                .unwrap();
            if !p.is_empty() {
                let data_slot = self.tx.slot(self.tx.free[n - 2]);
                self.mem.write_slice(p, GuestAddress(data_slot)).unwrap();
            }
            self.tx.add(&self.mem, &parts).unwrap();
            self.pending_tx.pop_front();
            sent = true;
        }
        if sent {
            self.kicks[1].write(1).unwrap();
        }
        sent
    }

    fn connect(&mut self, key: Key, buf_alloc: u32) {
        self.socks.insert(
            key,
            GSock {
                buf_alloc,
                consume: true,
                ..GSock::default()
            },
        );
        let h = self.hdr(key, op::REQUEST);
        self.send_raw(h, &[]);
    }

    /// Accepts a REQUEST the host sent.
    fn accept(&mut self, req: &Header, buf_alloc: u32) -> Key {
        let key = (req.dst_port, req.src_port);
        self.socks.insert(
            key,
            GSock {
                state: GState::Connected,
                buf_alloc,
                consume: true,
                peer_buf_alloc: req.buf_alloc,
                peer_fwd_cnt: req.fwd_cnt,
                ..GSock::default()
            },
        );
        let h = self.hdr(key, op::RESPONSE);
        self.send_raw(h, &[]);
        key
    }

    fn write(&mut self, key: Key, data: &[u8]) {
        self.socks.get_mut(&key).unwrap().out.extend(data);
    }

    fn send_op(&mut self, key: Key, op: u16, flags: u32) {
        let mut h = self.hdr(key, op);
        h.flags = flags;
        self.send_raw(h, &[]);
    }

    /// The application read `n` more bytes: credit goes back to the host.
    fn consume(&mut self, key: Key, n: u32) {
        let s = self.socks.get_mut(&key).unwrap();
        s.fwd_cnt = s.fwd_cnt.wrapping_add(n);
        s.last_fwd_sent = s.fwd_cnt;
        self.send_op(key, op::CREDIT_UPDATE, 0);
    }

    /// One round of driver work; true if anything happened.
    fn poll(&mut self) -> bool {
        let mut progress = false;
        while self.tx.pop_used(&self.mem).is_some() {
            progress = true;
        }
        let mut reposts = 0;
        while let Some((idxs, len)) = self.rx.pop_used(&self.mem) {
            progress = true;
            reposts += 1;
            if len == 0 {
                // A buffer the device could not use (the hostile-buffer tests post such).
                self.unusable_rx += 1;
                continue;
            }
            assert!(len as usize >= HDR_LEN, "rx packet of {len} bytes");
            let mut raw = [0u8; HDR_LEN];
            self.mem
                .read_slice(&mut raw, GuestAddress(self.rx.slot(idxs[0])))
                .unwrap();
            let h = Header::from_bytes(&raw);
            let plen = len as usize - HDR_LEN;
            assert_eq!(h.len as usize, plen, "header len vs used len");
            let mut payload = vec![0u8; plen];
            let at = if self.rx_two_desc {
                self.rx.slot(idxs[1])
            } else {
                self.rx.slot(idxs[0]) + HDR_LEN as u64
            };
            self.mem.read_slice(&mut payload, GuestAddress(at)).unwrap();
            self.on_packet(h, payload);
        }
        if self.repost_rx && reposts > 0 {
            self.post_rx(reposts);
        }
        while let Some((idxs, len)) = self.ev.pop_used(&self.mem) {
            progress = true;
            assert_eq!(len, 4);
            let id: u32 = self
                .mem
                .read_obj(GuestAddress(self.ev.slot(idxs[0])))
                .unwrap();
            self.events.push(id);
            // Like Linux: handle the event, then give the buffer back and kick (which tells
            // the device a transport reset has been handled).
            if self.repost_events {
                self.ev.add(&self.mem, &[(None, 4, F_WRITE)]);
                self.kicks[2].write(1).unwrap();
            }
        }
        // Credit returns and data within credit.
        let keys: Vec<Key> = self.socks.keys().copied().collect();
        for key in keys {
            let s = self.socks.get_mut(&key).unwrap();
            if s.state != GState::Connected {
                continue;
            }
            if s.consume && s.fwd_cnt.wrapping_sub(s.last_fwd_sent) >= s.buf_alloc / 4 {
                s.last_fwd_sent = s.fwd_cnt;
                self.send_op(key, op::CREDIT_UPDATE, 0);
            }
            loop {
                let s = self.socks.get_mut(&key).unwrap();
                if s.out.is_empty() || s.credit() == 0 {
                    break;
                }
                let n = s.out.len().min(s.credit() as usize).min(16 * 1024);
                let chunk: Vec<u8> = s.out.drain(..n).collect();
                s.tx_cnt = s.tx_cnt.wrapping_add(n as u32);
                let mut h = self.hdr(key, op::RW);
                h.len = n as u32;
                self.pending_tx.push_back((h, chunk));
                progress = true;
            }
        }
        progress |= self.flush_tx();
        progress
    }

    fn on_packet(&mut self, h: Header, payload: Vec<u8>) {
        assert_eq!(
            (h.src_cid, h.dst_cid, h.kind),
            (2, CID, TYPE_STREAM),
            "{h:?}"
        );
        self.log.push(h);
        let key = (h.dst_port, h.src_port);
        if h.op == op::REQUEST {
            self.incoming.push(h);
            return;
        }
        let Some(s) = self.socks.get_mut(&key) else {
            return;
        };
        s.peer_buf_alloc = h.buf_alloc;
        s.peer_fwd_cnt = h.fwd_cnt;
        match h.op {
            op::RESPONSE => s.state = GState::Connected,
            op::RST => s.state = GState::Reset,
            op::RW => {
                assert!(
                    s.data.len() as u64 + payload.len() as u64
                        <= u64::from(s.buf_alloc) + u64::from(s.fwd_cnt),
                    "host exceeded the guest's credit"
                );
                s.data.extend_from_slice(&payload);
                if s.consume {
                    s.fwd_cnt = s.fwd_cnt.wrapping_add(payload.len() as u32);
                }
            }
            op::SHUTDOWN => s.peer_shutdown |= h.flags,
            op::CREDIT_REQUEST => {
                s.credit_requests += 1;
                if s.consume {
                    s.last_fwd_sent = s.fwd_cnt;
                    self.send_op(key, op::CREDIT_UPDATE, 0);
                }
            }
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Device + event loop + guest.

struct Harness {
    em: EventManager<Arc<Mutex<Vsock>>>,
    dev: Arc<Mutex<Vsock>>,
    g: Guest,
    irq: Arc<Interrupt>,
    dir: tempfile::TempDir,
    uds: PathBuf,
}

fn guest_memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap()
}

fn rings(mem: &GuestMemoryMmap) -> (Ring, Ring, Ring, Vec<Queue>) {
    let (rx, qrx) = Ring::new(mem, 0x1_0000, 0x100_0000);
    let (tx, qtx) = Ring::new(mem, 0x2_0000, 0x200_0000);
    let (ev, qev) = Ring::new(mem, 0x3_0000, 0x300_0000);
    (rx, tx, ev, vec![qrx, qtx, qev])
}

fn kicks(dev: &Vsock) -> [EventFd; 3] {
    let e = dev.queue_events();
    [
        e[0].try_clone().unwrap(),
        e[1].try_clone().unwrap(),
        e[2].try_clone().unwrap(),
    ]
}

impl Harness {
    fn new() -> Self {
        Self::with(true, 100)
    }

    fn with(rx_two_desc: bool, rx_buffers: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("vsock.sock");
        let mut dev = Vsock::new(VsockConfig {
            guest_cid: CID,
            uds_path: uds.clone(),
        })
        .unwrap();
        let mem = guest_memory();
        let (rx, tx, ev, queues) = rings(&mem);
        dev.set_acked_features(VIRTIO_F_VERSION_1);
        let irq = Arc::new(Interrupt::new(EventTrigger::new().unwrap()));
        dev.activate(mem.clone(), irq.clone(), queues).unwrap();
        let g = Guest {
            mem,
            rx,
            tx,
            ev,
            kicks: kicks(&dev),
            rx_two_desc,
            repost_rx: true,
            socks: HashMap::new(),
            incoming: Vec::new(),
            log: Vec::new(),
            events: Vec::new(),
            repost_events: true,
            pending_tx: VecDeque::new(),
            unusable_rx: 0,
        };
        let dev = Arc::new(Mutex::new(dev));
        let mut em = EventManager::new().unwrap();
        em.add_subscriber(dev.clone());
        let mut h = Self {
            em,
            dev,
            g,
            irq,
            dir,
            uds,
        };
        h.g.post_rx(rx_buffers);
        h.g.post_events(4);
        h.settle();
        h
    }

    /// Runs the event loop until nothing is ready. A device that keeps itself busy (a level-
    /// triggered descriptor it never services) fails here.
    fn pump(&mut self) {
        let mut idle = 0;
        for _ in 0..100_000 {
            let n = self.em.run_with_timeout(0).unwrap();
            if n == 0 {
                idle += 1;
                if idle == 2 {
                    return;
                }
            } else {
                idle = 0;
            }
        }
        panic!("the event loop never goes idle");
    }

    /// Event loop and guest driver until neither has anything to do.
    fn settle(&mut self) {
        for _ in 0..100_000 {
            self.pump();
            if !self.g.poll() {
                return;
            }
        }
        panic!("guest and device never settle");
    }

    fn metrics(&self) -> ember_devices::virtio::vsock::VsockMetrics {
        self.dev.lock().unwrap().metrics()
    }

    fn connections(&self) -> usize {
        self.dev.lock().unwrap().connection_count()
    }

    /// A host client that asked for guest port `port`.
    fn host_connect(&mut self, port: u32) -> UnixStream {
        let mut c = UnixStream::connect(&self.uds).unwrap();
        c.write_all(format!("CONNECT {port}\n").as_bytes()).unwrap();
        c.set_nonblocking(true).unwrap();
        c
    }

    /// Host client + guest accept + `OK` line: returns the client and the guest-side key.
    fn open_from_host(&mut self, port: u32, guest_buf: u32) -> (UnixStream, Key) {
        let mut c = self.host_connect(port);
        self.settle();
        let req = self
            .g
            .incoming
            .iter()
            .rposition(|r| r.dst_port == port)
            .map(|i| self.g.incoming.remove(i))
            .expect("no REQUEST reached the guest");
        let key = self.g.accept(&req, guest_buf);
        self.settle();
        let line = read_avail(&mut c).0;
        assert_eq!(line, format!("OK {}\n", req.src_port).into_bytes());
        (c, key)
    }

    fn listen(&self, port: u32) -> UnixListener {
        let l = UnixListener::bind(port_path(&self.uds, port)).unwrap();
        l.set_nonblocking(true).unwrap();
        l
    }
}

fn port_path(base: &Path, port: u32) -> PathBuf {
    PathBuf::from(format!("{}_{port}", base.display()))
}

/// Everything readable now; `true` if the peer closed.
fn read_avail(s: &mut UnixStream) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return (out, true),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return (out, false),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return (out, true),
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// Writes as much as the socket takes now.
fn write_avail(s: &mut UnixStream, data: &[u8]) -> usize {
    let mut done = 0;
    while done < data.len() {
        match s.write(&data[done..]) {
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => panic!("write: {e}"),
        }
    }
    done
}

fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(31)
                .wrapping_add(seed.wrapping_mul(7)) as u8
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------

#[test]
fn host_initiated_connect_handshake_and_data() {
    let mut h = Harness::new();
    let mut c = h.host_connect(1234);
    h.settle();
    assert_eq!(h.g.incoming.len(), 1);
    let req = h.g.incoming[0];
    assert_eq!(
        (req.op, req.dst_port, req.dst_cid, req.src_cid),
        (op::REQUEST, 1234, CID, 2)
    );
    assert!(req.src_port >= 1 << 30);
    assert_eq!(req.buf_alloc, CONN_BUF_ALLOC);
    // Nothing goes back to the host before the guest answers.
    assert_eq!(read_avail(&mut c), (vec![], false));
    let key = h.g.accept(&req, 256 * 1024);
    h.settle();
    assert_eq!(
        read_avail(&mut c).0,
        format!("OK {}\n", req.src_port).into_bytes()
    );
    assert_eq!(h.connections(), 1);

    c.write_all(b"hello guest").unwrap();
    h.settle();
    assert_eq!(h.g.socks[&key].data, b"hello guest");
    h.g.write(key, b"hello host");
    h.settle();
    assert_eq!(read_avail(&mut c).0, b"hello host");
    // The interrupt line was raised for the used rings.
    assert!(h.irq.eventfd().read().unwrap() > 0);
}

#[test]
fn early_data_after_the_connect_line_is_kept() {
    let mut h = Harness::new();
    let mut c = UnixStream::connect(&h.uds).unwrap();
    c.write_all(b"CONNECT 7\nearly bird").unwrap();
    c.set_nonblocking(true).unwrap();
    h.settle();
    let req = h.g.incoming.pop().unwrap();
    let key = h.g.accept(&req, 4096);
    h.settle();
    assert_eq!(
        read_avail(&mut c).0,
        format!("OK {}\n", req.src_port).into_bytes()
    );
    assert_eq!(h.g.socks[&key].data, b"early bird");
}

#[test]
fn unanswered_host_connect_times_out_on_the_device_timer() {
    let mut h = Harness::new();
    let mut c = h.host_connect(98);
    h.settle();
    let req = h.g.incoming.pop().unwrap();
    // The guest never answers; the device's timer ends it after about 2 s.
    let start = std::time::Instant::now();
    let eof = loop {
        h.em.run_with_timeout(100).unwrap();
        h.g.poll();
        let (d, eof) = read_avail(&mut c);
        assert!(d.is_empty());
        if eof || start.elapsed() > std::time::Duration::from_secs(10) {
            break eof;
        }
    };
    assert!(eof, "the host client was never closed");
    assert!(start.elapsed() >= std::time::Duration::from_millis(1500));
    h.settle();
    let rst =
        h.g.log
            .iter()
            .find(|p| p.op == op::RST)
            .expect("no RST to the guest");
    assert_eq!((rst.src_port, rst.dst_port), (req.src_port, 98));
    assert_eq!(h.connections(), 0);
    // With nothing left to time, the timer stops: the loop sleeps.
    assert_eq!(h.em.run_with_timeout(600).unwrap(), 0);
}

#[test]
fn guest_refusal_closes_the_host_socket() {
    let mut h = Harness::new();
    let mut c = h.host_connect(99);
    h.settle();
    let req = h.g.incoming.pop().unwrap();
    let mut rst = req.reset_reply();
    rst.src_cid = CID;
    rst.dst_cid = 2;
    h.g.send_raw(rst, &[]);
    h.settle();
    assert_eq!(read_avail(&mut c), (vec![], true));
    assert_eq!(h.connections(), 0);
}

#[test]
fn bad_connect_lines_and_inactive_device_are_refused() {
    let mut h = Harness::new();
    let mut c = UnixStream::connect(&h.uds).unwrap();
    c.write_all(b"GET / HTTP/1.0\n").unwrap();
    c.set_nonblocking(true).unwrap();
    h.settle();
    assert_eq!(read_avail(&mut c), (vec![], true));
    assert!(h.g.incoming.is_empty());
    // After a driver reset the device is inactive: host clients are turned away.
    h.dev.lock().unwrap().reset();
    let mut c = h.host_connect(5);
    h.pump();
    assert_eq!(read_avail(&mut c), (vec![], true));
}

#[test]
fn guest_initiated_connect_and_data_both_ways() {
    // Single-descriptor rx buffers (header and data in one), as newer Linux guests post.
    let mut h = Harness::with(false, 100);
    let l = h.listen(5000);
    let key = (1000, 5000);
    h.g.connect(key, 256 * 1024);
    h.settle();
    assert_eq!(h.g.socks[&key].state, GState::Connected);
    let resp = h.g.log.iter().find(|p| p.op == op::RESPONSE).unwrap();
    assert_eq!(
        (resp.src_port, resp.dst_port, resp.buf_alloc),
        (5000, 1000, CONN_BUF_ALLOC)
    );
    let (mut s, _) = l.accept().unwrap();
    s.set_nonblocking(true).unwrap();

    let up = pattern(1, 300_000);
    h.g.write(key, &up);
    let down = pattern(2, 200_000);
    let mut sent = 0;
    let mut got = Vec::new();
    for _ in 0..1000 {
        sent += write_avail(&mut s, &down[sent..]);
        h.settle();
        got.extend(read_avail(&mut s).0);
        if got.len() == up.len() && h.g.socks[&key].data.len() == down.len() {
            break;
        }
    }
    assert_eq!(got, up);
    assert_eq!(h.g.socks[&key].data, down);
    assert_eq!(h.metrics().credit_violations, 0);
}

#[test]
fn connect_to_a_port_nobody_listens_on_is_reset() {
    let mut h = Harness::new();
    let key = (1001, 7777);
    h.g.connect(key, 4096);
    h.settle();
    assert_eq!(h.g.socks[&key].state, GState::Reset);
    assert_eq!(h.metrics().connect_failures, 1);
    assert_eq!(h.connections(), 0);
}

#[test]
fn host_to_guest_data_never_exceeds_guest_credit() {
    let mut h = Harness::new();
    let (mut c, key) = h.open_from_host(40, 1000);
    h.g.socks.get_mut(&key).unwrap().consume = false;
    let data = pattern(3, 10_000);
    c.write_all(&data).unwrap();
    h.settle();
    // Exactly the credit arrived (the guest stack asserts it never gets more), then the device
    // asked for credit once.
    assert_eq!(h.g.socks[&key].data.len(), 1000);
    assert_eq!(h.g.socks[&key].credit_requests, 1);
    let mut consumed = 1000;
    while consumed < data.len() as u32 {
        h.g.consume(key, 1000);
        consumed += 1000;
        h.settle();
        assert_eq!(h.g.socks[&key].data.len() as u32, consumed.min(10_000));
    }
    assert_eq!(h.g.socks[&key].data, data);
}

#[test]
fn guest_to_host_flow_control_with_a_slow_host_reader() {
    let mut h = Harness::new();
    let l = h.listen(6000);
    let key = (1002, 6000);
    h.g.connect(key, 256 * 1024);
    h.settle();
    let (mut s, _) = l.accept().unwrap();
    s.set_nonblocking(true).unwrap();
    let data = pattern(4, 3 << 20);
    h.g.write(key, &data);
    h.settle();
    // The host has not read: the guest is out of credit and stalls (socket buffer + our 256 KiB).
    let stalled = h.g.socks[&key].tx_cnt as usize;
    assert!(stalled < data.len(), "no backpressure at all");
    assert_eq!(h.g.socks[&key].credit(), 0);
    // Reading on the host sends credit back and the rest flows.
    let mut got = Vec::new();
    for _ in 0..10_000 {
        got.extend(read_avail(&mut s).0);
        h.settle();
        if got.len() == data.len() {
            break;
        }
    }
    assert_eq!(got.len(), data.len());
    assert!(got == data);
    assert_eq!(h.metrics().credit_violations, 0);
}

#[test]
fn guest_exceeding_its_credit_is_reset() {
    let mut h = Harness::new();
    let l = h.listen(6001);
    let key = (1003, 6001);
    h.g.connect(key, 256 * 1024);
    h.settle();
    let (mut s, _) = l.accept().unwrap();
    s.set_nonblocking(true).unwrap();
    // Ignore credit entirely.
    let chunk = vec![0x5au8; 64 * 1024];
    for _ in 0..64 {
        let mut hd = h.g.hdr(key, op::RW);
        hd.len = chunk.len() as u32;
        h.g.send_raw(hd, &chunk);
        h.settle();
        if h.g.socks[&key].state == GState::Reset {
            break;
        }
    }
    assert_eq!(h.g.socks[&key].state, GState::Reset);
    assert_eq!(h.metrics().credit_violations, 1);
    assert_eq!(h.connections(), 0);
    // The host gets what was accepted, then EOF.
    let mut total = 0;
    for _ in 0..100 {
        let (d, eof) = read_avail(&mut s);
        total += d.len();
        if eof {
            break;
        }
    }
    assert!(total > 0);
}

#[test]
fn hundred_concurrent_connections() {
    let mut h = Harness::new();
    let n = 100u32;
    let mut hosts = Vec::new();
    for i in 0..n {
        let c = h.host_connect(3000 + i);
        hosts.push(c);
    }
    h.settle();
    assert_eq!(h.g.incoming.len(), n as usize);
    let reqs = std::mem::take(&mut h.g.incoming);
    let mut keys = HashMap::new();
    for r in &reqs {
        keys.insert(r.dst_port, h.g.accept(r, 64 * 1024));
    }
    h.settle();
    // Plus guest-initiated ones at the same time.
    let listeners: Vec<UnixListener> = (0..20).map(|i| h.listen(9000 + i)).collect();
    for i in 0..20u32 {
        h.g.connect((20_000 + i, 9000 + i), 64 * 1024);
    }
    h.settle();
    assert_eq!(h.connections(), n as usize + 20);
    let mut guest_side: Vec<UnixStream> = listeners
        .iter()
        .map(|l| {
            let (s, _) = l.accept().unwrap();
            s.set_nonblocking(true).unwrap();
            s
        })
        .collect();

    let mut expect_up = HashMap::new();
    for (i, c) in hosts.iter_mut().enumerate() {
        let port = 3000 + i as u32;
        let key = keys[&port];
        let ok = read_avail(c).0;
        assert!(ok.starts_with(b"OK "), "{i}: {ok:?}");
        c.write_all(&pattern(port, 10_000)).unwrap();
        h.g.write(key, &pattern(port + 1, 12_000));
        expect_up.insert(i, pattern(port + 1, 12_000));
    }
    for (i, s) in guest_side.iter_mut().enumerate() {
        s.write_all(&pattern(i as u32 + 50, 5_000)).unwrap();
        h.g.write(
            (20_000 + i as u32, 9000 + i as u32),
            &pattern(i as u32 + 60, 7_000),
        );
    }
    let mut got_up: HashMap<usize, Vec<u8>> = HashMap::new();
    let mut got_gs: HashMap<usize, Vec<u8>> = HashMap::new();
    for _ in 0..100 {
        h.settle();
        for (i, c) in hosts.iter_mut().enumerate() {
            got_up.entry(i).or_default().extend(read_avail(c).0);
        }
        for (i, s) in guest_side.iter_mut().enumerate() {
            got_gs.entry(i).or_default().extend(read_avail(s).0);
        }
        let done = (0..n as usize).all(|i| got_up[&i].len() == 12_000)
            && (0..20).all(|i| got_gs[&i].len() == 7_000);
        if done {
            break;
        }
    }
    for i in 0..n as usize {
        let port = 3000 + i as u32;
        assert_eq!(got_up[&i], expect_up[&i], "host client {i}");
        assert_eq!(
            h.g.socks[&keys[&port]].data,
            pattern(port, 10_000),
            "guest side {i}"
        );
    }
    for i in 0..20u32 {
        assert_eq!(got_gs[&(i as usize)], pattern(i + 60, 7_000));
        assert_eq!(
            h.g.socks[&(20_000 + i, 9000 + i)].data,
            pattern(i + 50, 5_000)
        );
    }
    assert_eq!(h.metrics().conns_opened, u64::from(n) + 20);
}

#[test]
fn a_guest_that_stops_reading_does_not_stall_other_connections() {
    let mut h = Harness::new();
    let (mut stuck, stuck_key) = h.open_from_host(41, 4096);
    h.g.socks.get_mut(&stuck_key).unwrap().consume = false;
    let (mut ok, ok_key) = h.open_from_host(42, 256 * 1024);
    // The host floods the stuck connection: the device reads only the guest's credit and then
    // stops reading, so the host's socket fills up and its writes block.
    let flood = vec![7u8; 4 << 20];
    let mut pushed = 0;
    for _ in 0..50 {
        pushed += write_avail(&mut stuck, &flood[pushed..]);
        h.settle();
    }
    assert!(
        pushed < flood.len(),
        "the device kept reading a connection without credit"
    );
    assert_eq!(h.g.socks[&stuck_key].data.len(), 4096);
    // The other connection is unaffected in both directions.
    ok.write_all(&pattern(9, 100_000)).unwrap();
    h.g.write(ok_key, &pattern(10, 100_000));
    let mut got = Vec::new();
    for _ in 0..100 {
        h.settle();
        got.extend(read_avail(&mut ok).0);
        if got.len() == 100_000 && h.g.socks[&ok_key].data.len() == 100_000 {
            break;
        }
    }
    assert_eq!(got, pattern(10, 100_000));
    assert_eq!(h.g.socks[&ok_key].data, pattern(9, 100_000));
    // And the event loop is idle, not spinning on the stuck socket.
    assert_eq!(h.em.run_with_timeout(0).unwrap(), 0);
}

#[test]
fn no_rx_buffers_at_all_keeps_tx_flowing_and_the_loop_idle() {
    let mut h = Harness::new();
    let (mut a, a_key) = h.open_from_host(43, 256 * 1024);
    // The guest stops posting rx buffers and the ones it has get used up.
    h.g.repost_rx = false;
    let flood = pattern(11, 200 * RX_BUF as usize);
    let mut pushed = 0;
    for _ in 0..20 {
        pushed += write_avail(&mut a, &flood[pushed..]);
        h.settle();
    }
    assert_eq!(
        h.g.rx.free_count(),
        QSIZE as usize,
        "all rx buffers consumed"
    );
    // Guest -> host still works on another connection.
    let l = h.listen(6100);
    let b_key = (1100, 6100);
    h.g.connect(b_key, 256 * 1024);
    h.settle();
    let (mut s, _) = l.accept().unwrap();
    s.set_nonblocking(true).unwrap();
    // The RESPONSE cannot arrive (no rx buffers), so pretend the guest saw it: send data anyway
    // within the credit the REQUEST would have got.
    let mut hd = h.g.hdr(b_key, op::RW);
    hd.len = 5;
    h.g.send_raw(hd, b"still");
    h.settle();
    assert_eq!(read_avail(&mut s).0, b"still");
    assert_eq!(h.em.run_with_timeout(0).unwrap(), 0);
    // Buffers come back: everything waiting is delivered.
    h.g.repost_rx = true;
    h.g.post_rx(100);
    h.settle();
    assert_eq!(h.g.socks[&b_key].state, GState::Connected);
    for _ in 0..1000 {
        if pushed == flood.len() {
            break;
        }
        pushed += write_avail(&mut a, &flood[pushed..]);
        h.settle();
    }
    h.settle();
    assert_eq!(h.g.socks[&a_key].data, flood);
}

#[test]
fn shutdown_from_the_guest_then_host_close() {
    let mut h = Harness::new();
    let (mut c, key) = h.open_from_host(44, 256 * 1024);
    h.g.write(key, b"request");
    h.settle();
    h.g.send_op(key, op::SHUTDOWN, shutdown::SEND);
    h.settle();
    // The host sees the data, then EOF, and can still answer.
    assert_eq!(read_avail(&mut c), (b"request".to_vec(), true));
    c.write_all(b"response").unwrap();
    h.settle();
    assert_eq!(h.g.socks[&key].data, b"response");
    // The host closes: the guest gets SHUTDOWN(both) and answers RST.
    drop(c);
    h.settle();
    assert_eq!(h.g.socks[&key].peer_shutdown, shutdown::BOTH);
    assert_eq!(h.connections(), 1, "waiting for the guest's RST");
    h.g.send_op(key, op::RST, 0);
    h.settle();
    assert_eq!(h.connections(), 0);
}

#[test]
fn host_half_close_then_guest_full_shutdown() {
    let mut h = Harness::new();
    let (mut c, key) = h.open_from_host(45, 256 * 1024);
    c.write_all(b"all of it").unwrap();
    c.shutdown(std::net::Shutdown::Write).unwrap();
    h.settle();
    assert_eq!(h.g.socks[&key].data, b"all of it");
    assert_eq!(h.g.socks[&key].peer_shutdown, shutdown::SEND);
    // The guest can still send.
    h.g.write(key, b"reply");
    h.settle();
    assert_eq!(read_avail(&mut c).0, b"reply");
    // Guest closes: SHUTDOWN(both) is answered with RST and the host socket is closed.
    h.g.send_op(key, op::SHUTDOWN, shutdown::BOTH);
    h.settle();
    assert_eq!(h.g.socks[&key].state, GState::Reset);
    assert_eq!(read_avail(&mut c), (vec![], true));
    assert_eq!(h.connections(), 0);
}

#[test]
fn host_close_with_unread_data_delivers_it_first() {
    let mut h = Harness::new();
    let (mut c, key) = h.open_from_host(46, 2000);
    h.g.socks.get_mut(&key).unwrap().consume = false;
    c.write_all(&pattern(5, 5000)).unwrap();
    drop(c);
    h.settle();
    assert_eq!(h.g.socks[&key].data.len(), 2000);
    // The host can receive no more (RCV may be announced at once), but SEND must follow the
    // last data.
    assert_eq!(h.g.socks[&key].peer_shutdown & shutdown::SEND, 0);
    h.g.consume(key, 2000);
    h.settle();
    h.g.consume(key, 2000);
    h.settle();
    assert_eq!(h.g.socks[&key].data, pattern(5, 5000));
    assert_eq!(h.g.socks[&key].peer_shutdown, shutdown::BOTH);
    // No RST from the guest: the device gives up after its close timeout (checked in unit
    // tests); the connection is still tracked until then.
    assert_eq!(h.connections(), 1);
}

#[test]
fn guest_rst_closes_the_host_socket() {
    let mut h = Harness::new();
    let (mut c, key) = h.open_from_host(47, 4096);
    h.g.send_op(key, op::RST, 0);
    h.settle();
    assert_eq!(read_avail(&mut c), (vec![], true));
    assert_eq!(h.connections(), 0);
    // Data for the dead connection is answered with RST.
    h.g.socks.get_mut(&key).unwrap().state = GState::Connected;
    let mut hd = h.g.hdr(key, op::RW);
    hd.len = 3;
    h.g.send_raw(hd, b"abc");
    h.settle();
    assert_eq!(h.g.socks[&key].state, GState::Reset);
}

#[test]
fn malformed_packets_do_not_panic_and_are_counted() {
    let mut h = Harness::new();
    let mem = h.g.mem.clone();
    let base = h.metrics();
    // Header shorter than 44 bytes.
    h.g.tx.add(&mem, &[(None, 20, 0)]).unwrap();
    // No readable descriptor at all.
    h.g.tx.add(&mem, &[(None, 64, F_WRITE)]).unwrap();
    // Descriptor outside guest memory.
    h.g.tx.add(&mem, &[(Some(MEM_SIZE - 16), 64, 0)]).unwrap();
    h.g.kicks[1].write(1).unwrap();
    h.settle();
    let m = h.metrics();
    assert_eq!(m.malformed - base.malformed, 3);

    // Wrong source CID, wrong destination CID: dropped silently.
    let mut hd = h.g.hdr((1, 2), op::REQUEST);
    hd.src_cid = 99;
    h.g.send_raw(hd, &[]);
    let mut hd = h.g.hdr((1, 2), op::REQUEST);
    hd.dst_cid = 1;
    h.g.send_raw(hd, &[]);
    h.settle();
    assert_eq!(h.metrics().bad_address - base.bad_address, 2);
    let rsts = |h: &Harness| h.g.log.iter().filter(|p| p.op == op::RST).count();
    assert_eq!(rsts(&h), 0);

    // Unknown op, data for no connection, a foreign socket type: RST.
    h.g.send_raw(h.g.hdr((1, 2), 42), &[]);
    let mut hd = h.g.hdr((1, 3), op::RW);
    hd.len = 4;
    h.g.send_raw(hd, b"data");
    let mut hd = h.g.hdr((1, 4), op::REQUEST);
    hd.kind = 2;
    h.g.send_raw(hd, &[]);
    h.settle();
    assert_eq!(rsts(&h), 3);

    // len larger than the chain, len larger than any packet: RST, counted as malformed.
    let mut hd = h.g.hdr((1, 5), op::RW);
    hd.len = 1000;
    h.g.send_raw(hd, b"short");
    let mut hd = h.g.hdr((1, 6), op::RW);
    hd.len = u32::MAX;
    h.g.send_raw(hd, &[]);
    h.settle();
    assert_eq!(rsts(&h), 5);
    assert_eq!(h.metrics().malformed - base.malformed, 5);

    // The same on a live connection resets just that connection.
    let (mut c, key) = h.open_from_host(48, 4096);
    let mut hd = h.g.hdr(key, op::RW);
    hd.len = 4096;
    h.g.send_raw(hd, b"tiny");
    h.settle();
    assert_eq!(h.g.socks[&key].state, GState::Reset);
    assert_eq!(read_avail(&mut c), (vec![], true));
}

#[test]
fn hostile_rx_buffers_do_not_panic() {
    let mut h = Harness::with(true, 0);
    let mem = h.g.mem.clone();
    h.g.repost_rx = false;
    let mut c = h.host_connect(49);
    // Read-only, too small for a header, outside guest memory.
    h.g.rx.add(&mem, &[(None, 4096, 0)]).unwrap();
    h.g.rx.add(&mem, &[(None, 10, F_WRITE)]).unwrap();
    h.g.rx
        .add(&mem, &[(Some(MEM_SIZE - 8), 4096, F_WRITE)])
        .unwrap();
    h.g.kicks[0].write(1).unwrap();
    h.settle();
    assert_eq!(h.g.unusable_rx, 3);
    assert_eq!(h.metrics().malformed, 3);
    assert!(h.g.incoming.is_empty());
    // Good buffers: the request that waited is delivered and the device still works.
    h.g.repost_rx = true;
    h.g.post_rx(10);
    h.settle();
    let req = h.g.incoming.pop().unwrap();
    assert_eq!(req.dst_port, 49);
    h.g.accept(&req, 4096);
    h.settle();
    assert!(read_avail(&mut c).0.starts_with(b"OK "));
}

#[test]
fn transport_reset_drops_everything_and_retargets() {
    let mut h = Harness::new();
    let (mut c1, _) = h.open_from_host(50, 4096);
    let l = h.listen(6200);
    h.g.connect((1200, 6200), 4096);
    h.settle();
    let (mut s, _) = l.accept().unwrap();
    s.set_nonblocking(true).unwrap();
    assert_eq!(h.connections(), 2);

    h.dev.lock().unwrap().send_transport_reset();
    h.settle();
    assert_eq!(h.g.events, vec![0]);
    assert_eq!(h.connections(), 0);
    assert_eq!(read_avail(&mut c1), (vec![], true));
    assert_eq!(read_avail(&mut s), (vec![], true));
    assert_eq!(h.metrics().transport_resets, 1);

    // A new socket path: the old file is gone, the new one works.
    let new_path = h.dir.path().join("clone.sock");
    h.dev
        .lock()
        .unwrap()
        .set_uds_path(new_path.clone())
        .unwrap();
    h.settle();
    assert!(!h.uds.exists());
    h.uds = new_path;
    let (mut c, key) = h.open_from_host(51, 4096);
    c.write_all(b"after reset").unwrap();
    h.settle();
    assert_eq!(h.g.socks[&key].data, b"after reset");
}

#[test]
fn transport_reset_waits_for_an_event_buffer() {
    let mut h = Harness::new();
    h.g.repost_events = false;
    // Use up the posted event buffers with resets, then one more with none posted.
    for _ in 0..4 {
        h.dev.lock().unwrap().send_transport_reset();
    }
    h.settle();
    assert_eq!(h.g.events.len(), 4);
    h.dev.lock().unwrap().send_transport_reset();
    h.settle();
    assert_eq!(h.g.events.len(), 4);
    h.g.post_events(1);
    h.settle();
    assert_eq!(h.g.events, vec![0; 5]);
}

#[test]
fn driver_reset_closes_host_sockets() {
    let mut h = Harness::new();
    let (mut c, _) = h.open_from_host(52, 4096);
    h.dev.lock().unwrap().reset();
    h.pump();
    assert_eq!(read_avail(&mut c), (vec![], true));
    assert!(!h.dev.lock().unwrap().is_activated());
}

#[test]
fn persist_round_trip_resumes_with_a_transport_reset() {
    let mut h = Harness::new();
    let (mut c, key) = h.open_from_host(53, 4096);
    c.write_all(b"before").unwrap();
    h.settle();
    assert_eq!(h.g.socks[&key].data, b"before");

    let state = h.dev.lock().unwrap().save();
    assert!(state.activated);
    assert_eq!(state.guest_cid, CID);
    assert_eq!(state.acked_features, VIRTIO_F_VERSION_1);
    assert_eq!(state.queues.len(), 3);
    let bytes = ember_snapshot::encode_state(&state).unwrap();
    let mut back: VsockState = ember_snapshot::decode_state(&bytes).unwrap();
    assert_eq!(back, state);
    // As a format-1 snapshot (or `--vsock-transport-reset`): no connections.
    assert_eq!(
        back.connections.as_ref().map(|c| c.preserved.len()),
        Some(1)
    );
    back.connections = None;

    // The "old process" goes away; a clone restores on a new socket path.
    let Harness {
        em,
        dev,
        mut g,
        irq,
        dir,
        ..
    } = h;
    drop(em);
    drop(dev);
    assert_eq!(read_avail(&mut c), (vec![], true));
    let uds = dir.path().join("restored.sock");
    let cfg = VsockConfig {
        guest_cid: CID,
        uds_path: uds.clone(),
    };
    let restored = Vsock::restore((cfg, Some((g.mem.clone(), irq.clone()))), &back).unwrap();
    assert!(restored.is_activated());
    assert_eq!(restored.connection_count(), 0);
    // rx and tx resume where they were; the transport reset already used an event buffer.
    let now = restored.save();
    assert_eq!(now.queues[..2], state.queues[..2]);
    assert_eq!(
        now.queues[2].next_used,
        state.queues[2].next_used.wrapping_add(1)
    );
    g.kicks = kicks(&restored);
    let dev = Arc::new(Mutex::new(restored));
    let mut em = EventManager::new().unwrap();
    em.add_subscriber(dev.clone());
    let mut h = Harness {
        em,
        dev,
        g,
        irq,
        dir,
        uds,
    };
    h.settle();
    // The guest learns that every connection is gone.
    assert_eq!(h.g.events, vec![0]);
    // The same rings keep working with the restored queue positions.
    let (mut c, key) = h.open_from_host(54, 4096);
    c.write_all(b"after").unwrap();
    h.g.write(key, b"back");
    h.settle();
    assert_eq!(h.g.socks[&key].data, b"after");
    assert_eq!(read_avail(&mut c).0, b"back");
}

#[test]
fn persist_round_trip_keeps_idle_connections_for_attach() {
    let mut h = Harness::new();
    let (mut c, key) = h.open_from_host(53, 4096);
    c.write_all(b"before").unwrap();
    h.settle();
    assert_eq!(h.g.socks[&key].data, b"before");
    // A second connection the guest has not accepted yet is not kept: it is reset.
    let _pending = h.host_connect(77);
    h.settle();
    let state = h.dev.lock().unwrap().save();
    let saved = state.connections.clone().expect("connections saved");
    assert_eq!(saved.preserved.len(), 1);
    assert_eq!(saved.reset.len(), 1);
    let bytes = ember_snapshot::encode_state(&state).unwrap();
    let back: VsockState = ember_snapshot::decode_state(&bytes).unwrap();
    assert_eq!(back, state);

    let Harness {
        em,
        dev,
        mut g,
        irq,
        dir,
        ..
    } = h;
    drop(em);
    drop(dev);
    drop(c);
    let uds = dir.path().join("restored.sock");
    let cfg = VsockConfig {
        guest_cid: CID,
        uds_path: uds.clone(),
    };
    let restored = Vsock::restore((cfg, Some((g.mem.clone(), irq.clone()))), &back).unwrap();
    assert_eq!(restored.connection_count(), 1);
    assert_eq!(restored.detached_count(), 1);
    // No transport reset: the event queue is untouched.
    assert_eq!(restored.save().queues[2], state.queues[2]);
    g.kicks = kicks(&restored);
    let dev = Arc::new(Mutex::new(restored));
    let mut em = EventManager::new().unwrap();
    em.add_subscriber(dev.clone());
    let mut h = Harness {
        em,
        dev,
        g,
        irq,
        dir,
        uds,
    };
    g_incoming_clear(&mut h);
    h.settle();
    assert!(h.g.events.is_empty(), "a transport reset went out");
    // The guest wrote before anyone attached.
    h.g.write(key, b"kept ");
    h.settle();
    // ATTACH: OK at once, then the stream continues on the guest's same socket.
    let mut a = UnixStream::connect(&h.uds).unwrap();
    a.write_all(b"ATTACH 53\nagain").unwrap();
    a.set_nonblocking(true).unwrap();
    h.settle();
    let (got, _) = read_avail(&mut a);
    assert_eq!(
        String::from_utf8_lossy(&got),
        format!("OK {}\nkept ", key.1)
    );
    assert_eq!(h.g.socks[&key].data, b"beforeagain");
    assert!(
        !h.g.incoming.iter().any(|r| r.dst_port == 53),
        "ATTACH made a new connection"
    );
    h.g.write(key, b"reply");
    h.settle();
    assert_eq!(read_avail(&mut a).0, b"reply");
    assert_eq!(h.dev.lock().unwrap().metrics().preserved_attached, 1);
}

/// Forgets the requests the guest saw before the snapshot.
fn g_incoming_clear(h: &mut Harness) {
    h.g.incoming.clear();
}

#[test]
fn host_connections_wait_until_the_guest_has_handled_a_transport_reset() {
    // Without this, a host connection made right after a restore reaches the guest before the
    // guest processes the reset, and the guest's reset handling then tears it down.
    let mut h = Harness::new();
    h.g.repost_events = false;
    h.dev.lock().unwrap().send_transport_reset();
    h.settle();
    assert_eq!(h.g.events, vec![0]);
    let _c = h.host_connect(60);
    h.settle();
    assert!(
        !h.g.incoming.iter().any(|r| r.dst_port == 60),
        "a REQUEST went out before the guest acknowledged the reset"
    );
    // The guest hands the event buffer back (what Linux does once it reset its sockets).
    h.g.post_events(1);
    h.settle();
    assert!(h.g.incoming.iter().any(|r| r.dst_port == 60));
}

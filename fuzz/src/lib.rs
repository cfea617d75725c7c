//! Fuzz targets for ember's virtio devices.
//!
//! The guest controls every byte of a virtqueue, so each device target builds guest memory and
//! a ready queue from the fuzz input ([`queue`], shared by all devices) and runs the device's
//! real queue processing on it. The targets' bodies live here, not in `fuzz_targets/`, so they
//! build and run on a stable toolchain too: `cargo test` in this directory replays the seed
//! corpus (and anything else under `corpus/`) through them.
//!
//! Targets:
//! - `fuzz_block` ([`block`]): virtio-blk in read-only, read-write and overlay modes.
//! - `fuzz_vsock` ([`vsock`]): virtio-vsock, all three queues, with host Unix sockets.
//! - `fuzz_net` ([`net`]): virtio-net, receive and transmit queues, on a Unix datagram socket
//!   pair standing in for the TAP.

pub mod block;
pub mod net;
pub mod queue;
pub mod vsock;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A private scratch directory for a target's files (disk images, sockets), removed on drop.
///
/// It is made under `EMBER_FUZZ_SCRATCH`, else `/dev/shm` (tmpfs: the devices fsync, which
/// costs milliseconds on a real disk), else the temporary directory. libFuzzer exits without
/// running destructors, so `run.sh` points `EMBER_FUZZ_SCRATCH` at a directory it removes.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// A new directory named after `tag`, the process and a counter.
    pub fn new(tag: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let parent = std::env::var_os("EMBER_FUZZ_SCRATCH")
            .map(PathBuf::from)
            .or_else(|| Some(PathBuf::from("/dev/shm")).filter(|p| p.is_dir()))
            .unwrap_or_else(std::env::temp_dir);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = parent.join(format!("ember-fuzz-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("fuzz harness: scratch directory");
        ScratchDir(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Hand-made seed inputs, by corpus directory (`corpus/<target>/<name>`).
pub mod seeds {
    use crate::queue::{FuzzInput, VirtqInput, F_INDIRECT, F_NEXT, F_WRITE, PAYLOAD};

    const T_IN: u32 = 0;
    const T_OUT: u32 = 1;
    const T_FLUSH: u32 = 4;
    const T_GET_ID: u32 = 8;

    /// Where block request `k`'s status byte lands.
    pub fn status_addr(k: usize) -> u64 {
        PAYLOAD + 0x100 + k as u64
    }

    /// Block requests: headers at `PAYLOAD + 16 k`, status bytes at [`status_addr`], data from
    /// `PAYLOAD + 0x1000` on.
    struct Builder {
        input: FuzzInput,
        data_at: u64,
    }

    impl Builder {
        fn new(selector: u8) -> Self {
            Builder {
                input: FuzzInput {
                    selector,
                    queues: vec![VirtqInput {
                        queue_size: 16,
                        ..VirtqInput::default()
                    }],
                    payload: vec![0u8; 0x1000],
                },
                data_at: PAYLOAD + 0x1000,
            }
        }

        fn q(&mut self) -> &mut VirtqInput {
            &mut self.input.queues[0]
        }

        fn header(&mut self, k: usize, kind: u32, sector: u64) -> u64 {
            let at = PAYLOAD + 16 * k as u64;
            let mut h = [0u8; 16];
            h[..4].copy_from_slice(&kind.to_le_bytes());
            h[8..].copy_from_slice(&sector.to_le_bytes());
            self.input.put(at, &h);
            at
        }

        /// Room for `len` data bytes (filled with `fill`); returns its guest address.
        fn data(&mut self, len: usize, fill: u8) -> u64 {
            let at = self.data_at;
            self.input.put(at, &vec![fill; len]);
            self.data_at += len as u64;
            at
        }

        /// Adds a chain: header, optional data buffer (length, device-writable), status byte.
        fn request(&mut self, kind: u32, sector: u64, data: Option<(usize, bool)>) {
            let k = self.q().avail.len();
            let hdr = self.header(k, kind, sector);
            let mut chain = vec![(hdr, 16, 0)];
            if let Some((len, device_writes)) = data {
                let at = self.data(len, 0xa0 + k as u8);
                chain.push((at, len as u32, if device_writes { F_WRITE } else { 0 }));
            }
            chain.push((status_addr(k), 1, F_WRITE));
            self.q().push_chain(&chain);
        }

        fn finish(self) -> Vec<u8> {
            self.input.encode()
        }
    }

    /// Read-only disk: a two-sector read.
    pub fn ro_read() -> Vec<u8> {
        let mut b = Builder::new(0);
        b.request(T_IN, 2, Some((1024, true)));
        b.finish()
    }

    /// Read-write disk with FLUSH acked: write, flush, read back, GET_ID.
    pub fn rw_write_flush_read_id() -> Vec<u8> {
        let mut b = Builder::new(1 | 4);
        b.request(T_OUT, 5, Some((512, false)));
        b.request(T_FLUSH, 0, None);
        b.request(T_IN, 5, Some((512, true)));
        b.request(T_GET_ID, 0, Some((20, true)));
        b.finish()
    }

    /// Overlay with FLUSH acked, then snapshot/restore: a partial-cluster write, a write
    /// across the cluster boundary, flush, read across it.
    pub fn overlay_cow_then_snapshot() -> Vec<u8> {
        let mut b = Builder::new(2 | 4 | 8);
        b.request(T_OUT, 3, Some((512, false)));
        b.request(T_OUT, 126, Some((2048, false)));
        b.request(T_FLUSH, 0, None);
        b.request(T_IN, 120, Some((8192, true)));
        b.finish()
    }

    /// Overlay without FLUSH (write-through), event index on, and an indirect read.
    pub fn overlay_indirect_event_idx() -> Vec<u8> {
        let mut b = Builder::new(3);
        b.q().event_idx = true;
        b.request(T_OUT, 127, Some((512, false)));
        // An indirect table of three descriptors: header, data, status.
        let k = b.q().avail.len();
        let hdr = b.header(k, T_IN, 127);
        let data = b.data(512, 0);
        let mut table = Vec::new();
        for (addr, len, flags, next) in [
            (hdr, 16u32, F_NEXT, 1u16),
            (data, 512, F_NEXT | F_WRITE, 2),
            (status_addr(k), 1, F_WRITE, 0),
        ] {
            table.extend_from_slice(&addr.to_le_bytes());
            table.extend_from_slice(&len.to_le_bytes());
            table.extend_from_slice(&flags.to_le_bytes());
            table.extend_from_slice(&next.to_le_bytes());
        }
        let table_at = b.data(table.len(), 0);
        b.input.put(table_at, &table);
        b.q().push_chain(&[(table_at, 48, F_INDIRECT)]);
        b.finish()
    }

    /// Malformed requests: out of range, partial sector, sector overflow, unknown type.
    pub fn rw_hostile() -> Vec<u8> {
        let mut b = Builder::new(1);
        b.request(T_IN, 255, Some((1024, true)));
        b.request(T_OUT, 0, Some((100, false)));
        b.request(T_IN, u64::MAX, Some((512, true)));
        b.request(99, 0, None);
        b.finish()
    }

    /// What a seed must do.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Expect {
        /// virtio-blk: the status each request completes with, in order.
        BlockStatuses(Vec<u8>),
        /// virtio-vsock: the number of tx chains consumed.
        TxConsumed(u16),
        /// virtio-net: the used indexes of the receive and transmit queues, and the outcome.
        Net {
            /// Receive queue's used index.
            rx_used: u16,
            /// Transmit queue's used index.
            tx_used: u16,
            /// What the device did.
            outcome: crate::net::Outcome,
        },
    }

    /// A seed input and what it must do.
    #[derive(Debug, Clone)]
    pub struct Seed {
        /// File name under `corpus/<target>/`.
        pub name: &'static str,
        /// The input.
        pub bytes: Vec<u8>,
        /// The outcome.
        pub expect: Expect,
    }

    /// Every `fuzz_block` seed.
    pub fn fuzz_block() -> Vec<Seed> {
        let seed = |name, bytes, statuses| Seed {
            name,
            bytes,
            expect: Expect::BlockStatuses(statuses),
        };
        vec![
            seed("ro_read", ro_read(), vec![0]),
            seed(
                "rw_write_flush_read_id",
                rw_write_flush_read_id(),
                vec![0; 4],
            ),
            seed(
                "overlay_cow_then_snapshot",
                overlay_cow_then_snapshot(),
                vec![0; 4],
            ),
            seed(
                "overlay_indirect_event_idx",
                overlay_indirect_event_idx(),
                vec![0; 2],
            ),
            seed("rw_hostile", rw_hostile(), vec![1, 1, 1, 2]),
        ]
    }

    /// vsock packets: tx headers and payloads from `PAYLOAD`, rx and event buffers from
    /// `PAYLOAD + 0x8000`.
    struct VsockBuilder {
        input: FuzzInput,
        tx_at: u64,
        rx_at: u64,
    }

    const OP_REQUEST: u16 = 1;
    const OP_RESPONSE: u16 = 2;
    const OP_RST: u16 = 3;
    const OP_SHUTDOWN: u16 = 4;
    const OP_RW: u16 = 5;
    const OP_CREDIT_REQUEST: u16 = 7;

    /// A guest → host stream packet header (virtio 1.2 §5.10.6).
    fn vsock_hdr(src_port: u32, dst_port: u32, op: u16, len: u32, flags: u32) -> Vec<u8> {
        let mut h = Vec::with_capacity(44);
        h.extend_from_slice(&crate::vsock::GUEST_CID.to_le_bytes());
        h.extend_from_slice(&2u64.to_le_bytes());
        h.extend_from_slice(&src_port.to_le_bytes());
        h.extend_from_slice(&dst_port.to_le_bytes());
        h.extend_from_slice(&len.to_le_bytes());
        h.extend_from_slice(&1u16.to_le_bytes()); // stream
        h.extend_from_slice(&op.to_le_bytes());
        h.extend_from_slice(&flags.to_le_bytes());
        h.extend_from_slice(&65536u32.to_le_bytes()); // buf_alloc
        h.extend_from_slice(&0u32.to_le_bytes()); // fwd_cnt
        h
    }

    impl VsockBuilder {
        fn new(selector: u8, rx_buffers: usize) -> Self {
            let q = VirtqInput {
                queue_size: 16,
                ..VirtqInput::default()
            };
            let mut b = VsockBuilder {
                input: FuzzInput {
                    selector,
                    queues: vec![q.clone(), q.clone(), q],
                    payload: Vec::new(),
                },
                tx_at: PAYLOAD,
                rx_at: PAYLOAD + 0x8000,
            };
            for _ in 0..rx_buffers {
                let at = b.rx_at;
                b.input.queues[0].push_chain(&[(at, 44 + 4096, F_WRITE)]);
                b.rx_at += 44 + 4096;
            }
            let at = b.rx_at;
            b.input.queues[2].push_chain(&[(at, 4, F_WRITE)]);
            b.input.put(at, &[0; 4]);
            b
        }

        /// A tx chain: `hdr` in one descriptor, `payload` (if any) in the next.
        fn tx(&mut self, hdr: &[u8], payload: &[u8]) {
            let h = self.tx_at;
            self.input.put(h, hdr);
            let mut chain = vec![(h, hdr.len() as u32, 0)];
            self.tx_at += hdr.len() as u64;
            if !payload.is_empty() {
                self.input.put(self.tx_at, payload);
                chain.push((self.tx_at, payload.len() as u32, 0));
                self.tx_at += payload.len() as u64;
            }
            self.input.queues[1].push_chain(&chain);
        }

        fn finish(self) -> Vec<u8> {
            self.input.encode()
        }
    }

    /// The guest connects to the host listener, sends data, asks for credit, shuts down.
    pub fn vsock_guest_connect() -> Vec<u8> {
        let port = crate::vsock::HOST_PORT;
        let mut b = VsockBuilder::new(0, 8);
        b.tx(&vsock_hdr(1000, port, OP_REQUEST, 0, 0), &[]);
        b.tx(&vsock_hdr(1000, port, OP_RW, 4, 0), b"ping");
        b.tx(&vsock_hdr(1000, port, OP_CREDIT_REQUEST, 0, 0), &[]);
        b.tx(&vsock_hdr(1000, port, OP_SHUTDOWN, 0, 3), &[]);
        b.tx(&vsock_hdr(1000, port, OP_RST, 0, 0), &[]);
        b.finish()
    }

    /// A connection to a port nobody listens on, and data on a connection that does not exist.
    pub fn vsock_refused() -> Vec<u8> {
        let mut b = VsockBuilder::new(0, 4);
        b.tx(&vsock_hdr(1001, 7, OP_REQUEST, 0, 0), &[]);
        b.tx(&vsock_hdr(1002, 8, OP_RW, 3, 0), b"abc");
        b.finish()
    }

    /// A host client asks for guest port 5000; the guest answers early (before the request).
    pub fn vsock_host_connect() -> Vec<u8> {
        let mut b = VsockBuilder::new(1, 8);
        b.tx(&vsock_hdr(5000, 1 << 30, OP_RESPONSE, 0, 0), &[]);
        b.finish()
    }

    /// Short header, wrong CIDs, a payload shorter than its length, a huge length.
    pub fn vsock_malformed() -> Vec<u8> {
        let mut b = VsockBuilder::new(0, 2);
        let port = crate::vsock::HOST_PORT;
        b.tx(&vsock_hdr(1, port, OP_REQUEST, 0, 0)[..20], &[]);
        let mut wrong_cid = vsock_hdr(1, port, OP_REQUEST, 0, 0);
        wrong_cid[0] = 9;
        b.tx(&wrong_cid, &[]);
        b.tx(&vsock_hdr(1, port, OP_RW, 100, 0), b"0123456789");
        b.tx(&vsock_hdr(1, port, OP_RW, u32::MAX, 0), b"x");
        b.finish()
    }

    /// Every `fuzz_vsock` seed.
    pub fn fuzz_vsock() -> Vec<Seed> {
        let seed = |name, bytes, tx| Seed {
            name,
            bytes,
            expect: Expect::TxConsumed(tx),
        };
        vec![
            seed("guest_connect", vsock_guest_connect(), 5),
            seed("refused", vsock_refused(), 2),
            seed("host_connect", vsock_host_connect(), 1),
            seed("malformed", vsock_malformed(), 4),
        ]
    }

    /// virtio-net chains: network frames for `traffic::INPUT` at `net::INPUT_FRAMES` (the
    /// start of the payload), transmit headers and frames after them, receive buffers from
    /// [`NET_RX_BUFFERS`] (left out of the payload: the device fills them).
    struct NetBuilder {
        input: FuzzInput,
        tx_at: u64,
        rx_at: u64,
    }

    /// Where the net seeds' receive buffers start.
    pub const NET_RX_BUFFERS: u64 = PAYLOAD + 0x1_8000;

    /// The host's MAC in the frames the guest sends.
    const HOST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 1];
    const NEEDS_CSUM: u8 = 1;
    const GSO_TCPV4: u8 = 1;
    const GSO_UDP: u8 = 3;
    const GSO_TCPV6: u8 = 4;
    const GSO_ECN: u8 = 0x80;

    /// A `virtio_net_hdr_v1`: flags, GSO type, header length, GSO size, checksum start/offset.
    fn net_hdr(flags: u8, gso: u8, hdr_len: u16, gso_size: u16, csum: (u16, u16)) -> [u8; 12] {
        let mut h = [0u8; 12];
        h[0] = flags;
        h[1] = gso;
        h[2..4].copy_from_slice(&hdr_len.to_le_bytes());
        h[4..6].copy_from_slice(&gso_size.to_le_bytes());
        h[6..8].copy_from_slice(&csum.0.to_le_bytes());
        h[8..10].copy_from_slice(&csum.1.to_le_bytes());
        h
    }

    /// A TCP/IPv4-ish checksum-offload header (csum_start 34, csum_offset 16).
    fn csum_hdr(gso: u8, gso_size: u16) -> [u8; 12] {
        net_hdr(NEEDS_CSUM, gso, 54, gso_size, (34, 16))
    }

    /// An Ethernet frame of `len` bytes from `src` to `dst` (IPv4 ethertype, filler body).
    fn eth(dst: [u8; 6], src: [u8; 6], len: usize) -> Vec<u8> {
        let mut f = Vec::with_capacity(len);
        f.extend_from_slice(&dst);
        f.extend_from_slice(&src);
        f.extend_from_slice(&[0x08, 0x00]);
        f.extend((0..len.saturating_sub(14)).map(|i| (i * 7 % 256) as u8));
        f.truncate(len);
        f
    }

    fn guest_mac() -> [u8; 6] {
        ember_devices::virtio::net::MacAddr::derive(crate::net::TAP_NAME).bytes()
    }

    /// A frame from the guest to the host.
    fn out_frame(len: usize) -> Vec<u8> {
        eth(HOST_MAC, guest_mac(), len)
    }

    impl NetBuilder {
        fn new(selector: u8) -> Self {
            Self::with_net_frames(selector, &[])
        }

        /// A builder whose input also carries `frames` (vnet header, Ethernet frame) for the
        /// network to send each round with `traffic::INPUT`.
        fn with_net_frames(selector: u8, frames: &[([u8; 12], &[u8])]) -> Self {
            let q = VirtqInput {
                queue_size: 64,
                ..VirtqInput::default()
            };
            let mut b = NetBuilder {
                input: FuzzInput {
                    selector,
                    queues: vec![q.clone(), q],
                    payload: Vec::new(),
                },
                tx_at: crate::net::INPUT_FRAMES,
                rx_at: NET_RX_BUFFERS,
            };
            if !frames.is_empty() {
                assert!(frames.len() <= crate::net::MAX_INPUT_FRAMES);
                let mut region = vec![frames.len() as u8];
                for (hdr, frame) in frames {
                    let len = (hdr.len() + frame.len()) as u16;
                    region.extend_from_slice(&len.to_le_bytes());
                    region.extend_from_slice(hdr);
                    region.extend_from_slice(frame);
                }
                b.tx_data(&region);
            }
            b
        }

        fn event_idx(mut self) -> Self {
            for q in &mut self.input.queues {
                q.event_idx = true;
            }
            self
        }

        /// Guest memory for `bytes`, placed after the previous transmit data.
        fn tx_data(&mut self, bytes: &[u8]) -> u64 {
            let at = self.tx_at;
            self.input.put(at, bytes);
            self.tx_at += bytes.len() as u64;
            at
        }

        /// A transmit chain: `hdr` in its own descriptor (as Linux does), then `frame` cut
        /// into `pieces` descriptors.
        fn tx(&mut self, hdr: [u8; 12], frame: &[u8], pieces: usize) {
            let h = self.tx_data(&hdr);
            let mut chain = vec![(h, 12, 0)];
            let step = frame.len().div_ceil(pieces.max(1)).max(1);
            for part in frame.chunks(step) {
                let at = self.tx_data(part);
                chain.push((at, part.len() as u32, 0));
            }
            self.input.queues[1].push_chain(&chain);
        }

        /// A transmit chain of the header and frame in one descriptor.
        fn tx_one(&mut self, hdr: [u8; 12], frame: &[u8]) {
            let at = self.tx_data(&hdr);
            self.tx_data(frame);
            self.input.queues[1].push_chain(&[(at, 12 + frame.len() as u32, 0)]);
        }

        /// A transmit chain through an indirect table of two descriptors: header, frame.
        fn tx_indirect(&mut self, hdr: [u8; 12], frame: &[u8]) {
            let h = self.tx_data(&hdr);
            let f = self.tx_data(frame);
            let mut table = Vec::new();
            for (addr, len, flags, next) in
                [(h, 12u32, F_NEXT, 1u16), (f, frame.len() as u32, 0, 0)]
            {
                table.extend_from_slice(&addr.to_le_bytes());
                table.extend_from_slice(&len.to_le_bytes());
                table.extend_from_slice(&flags.to_le_bytes());
                table.extend_from_slice(&next.to_le_bytes());
            }
            let t = self.tx_data(&table);
            self.input.queues[1].push_chain(&[(t, 32, F_INDIRECT)]);
        }

        /// A transmit chain as given (for malformed ones).
        fn tx_raw(&mut self, chain: &[(u64, u32, u16)]) {
            self.input.queues[1].push_chain(chain);
        }

        /// `n` receive chains, each of buffers of the given sizes (device-writable).
        fn rx(&mut self, n: usize, sizes: &[u32]) {
            for _ in 0..n {
                let mut chain = Vec::new();
                for &len in sizes {
                    chain.push((self.rx_at, len, F_WRITE));
                    self.rx_at += u64::from(len);
                }
                self.input.queues[0].push_chain(&chain);
            }
        }

        /// A receive chain as given (for malformed ones).
        fn rx_raw(&mut self, chain: &[(u64, u32, u16)]) {
            self.input.queues[0].push_chain(chain);
        }

        fn finish(self) -> Vec<u8> {
            assert!(self.tx_at <= NET_RX_BUFFERS && self.rx_at <= crate::queue::MEM_SIZE);
            self.input.encode()
        }
    }

    /// No offloads, one small frame from the network per round: frames split like Linux's,
    /// a full-size one, one in a single descriptor.
    pub fn net_basic() -> Vec<u8> {
        use crate::net::traffic;
        let mut b = NetBuilder::new(traffic::bits(traffic::SMALL));
        b.tx([0; 12], &out_frame(60), 1);
        b.tx([0; 12], &out_frame(1514), 3);
        b.tx_one([0; 12], &out_frame(100));
        b.rx(8, &[1526 + 12]);
        b.finish()
    }

    /// Every offload and mergeable receive buffers, event index on: TSO frames out (one through
    /// an indirect table), GSO frames in spread over page-sized buffers.
    pub fn net_offloads_mergeable() -> Vec<u8> {
        use crate::net::{traffic, GUEST_OFFLOADS, HOST_OFFLOADS, MRG_RXBUF};
        let sel = MRG_RXBUF | GUEST_OFFLOADS | HOST_OFFLOADS | traffic::bits(traffic::GSO);
        let mut b = NetBuilder::new(sel).event_idx();
        b.tx(csum_hdr(GSO_TCPV4, 1448), &out_frame(8000), 3);
        b.tx(csum_hdr(GSO_TCPV6 | GSO_ECN, 1428), &out_frame(5000), 2);
        b.tx_indirect(csum_hdr(0, 0), &out_frame(600));
        // Four rounds of a 20000-byte and a 9000-byte frame: 5 + 3 pages each.
        b.rx(32, &[4096]);
        b.finish()
    }

    /// The driver posts one receive buffer per round while the network sends two frames: the
    /// device holds a frame, waits for the next buffer, and delivers it; the transmit chains
    /// arrive over the rounds too.
    pub fn net_rx_stall_and_resume() -> Vec<u8> {
        use crate::net::{traffic, STAGED};
        let mut b = NetBuilder::new(STAGED | traffic::bits(traffic::MTU));
        for len in [60, 200, 1514, 90] {
            b.tx([0; 12], &out_frame(len), 1);
        }
        // Header and data in separate buffers, like Linux's "big packets" mode.
        b.rx(4, &[12, 1514]);
        b.finish()
    }

    /// Mergeable buffers for exactly one largest frame: it is delivered in 17 pages, the
    /// over-long frame behind it dropped, the next largest one held for want of buffers.
    pub fn net_extremes_mergeable() -> Vec<u8> {
        use crate::net::{traffic, MRG_RXBUF};
        let mut b = NetBuilder::new(MRG_RXBUF | traffic::bits(traffic::EXTREMES));
        b.tx([0; 12], &out_frame(65_536 + 14 + 4), 17);
        b.rx(17, &[4096]);
        b.finish()
    }

    /// Malformed transmit and receive chains among good ones; runts from the network.
    pub fn net_hostile() -> Vec<u8> {
        use crate::net::traffic;
        use crate::queue::MEM_SIZE;
        let mut b = NetBuilder::new(traffic::bits(traffic::RUNTS));
        let good = out_frame(60);
        let mut frame = vec![0u8; 12];
        frame.extend_from_slice(&good);
        let at = b.tx_data(&frame);
        let len = frame.len() as u32;
        b.tx_raw(&[(at, len, 0), (at, 10, F_WRITE)]); // device-writable descriptor
        b.tx_raw(&[(at, 8, 0)]); // shorter than a vnet header
        b.tx_raw(&[(at, 12, 0), (at, 0, 0)]); // no Ethernet header
        b.tx_raw(&[(MEM_SIZE + 0x100, len, 0)]); // outside guest memory
        b.tx_raw(&[(at, 0x1_1000, 0)]); // longer than any frame
        b.tx_one(csum_hdr(0, 0), &good); // NEEDS_CSUM without CSUM
        b.tx_one(net_hdr(0, GSO_TCPV4, 54, 1448, (0, 0)), &good); // TSO without HOST_TSO4
        b.tx_one(net_hdr(0, GSO_UDP, 42, 1472, (0, 0)), &good); // UFO: never offered
        b.tx_raw(&[(at, len, 0)]); // fine
        let rx = b.rx_at;
        b.rx_raw(&[(rx, 1538, 0)]); // device-readable
        b.rx_raw(&[(rx, 0, F_WRITE)]); // empty
        b.rx_raw(&[(rx, 4, F_WRITE)]); // cannot hold a vnet header
        b.rx_raw(&[(MEM_SIZE + 0x100, 1538, F_WRITE)]); // outside guest memory
        b.rx_at += 0x1000;
        b.rx(4, &[1538]);
        b.finish()
    }

    /// Frames from the input: checksum-offloaded and TSO frames the guest accepted, a UFO frame
    /// and a runt it did not.
    pub fn net_input_frames() -> Vec<u8> {
        use crate::net::{traffic, GUEST_OFFLOADS};
        let inbound = eth(guest_mac(), HOST_MAC, 1000);
        let frames = [
            (net_hdr(2, 0, 0, 0, (0, 0)), &inbound[..60]), // DATA_VALID
            (csum_hdr(GSO_TCPV4, 500), &inbound[..]),
            (net_hdr(0, GSO_UDP, 42, 500, (0, 0)), &inbound[..]),
            ([0; 12], &inbound[..5]),
        ];
        let sel = GUEST_OFFLOADS | traffic::bits(traffic::INPUT);
        let mut b = NetBuilder::with_net_frames(sel, &frames);
        b.tx([0; 12], &out_frame(60), 1);
        b.rx(8, &[1526 + 12]);
        b.finish()
    }

    /// The network is gone: every transmit fails and is still completed.
    pub fn net_closed() -> Vec<u8> {
        use crate::net::traffic;
        let mut b = NetBuilder::new(traffic::bits(traffic::CLOSED));
        b.tx([0; 12], &out_frame(60), 1);
        b.tx([0; 12], &out_frame(1514), 2);
        b.rx(2, &[1538]);
        b.finish()
    }

    /// Saved after the first round and restored onto a new socket pair: the new device picks
    /// up the receive queue where the old one left off; transmit chains arrive on both sides
    /// of the restore.
    pub fn net_restore() -> Vec<u8> {
        use crate::net::{traffic, HOST_OFFLOADS, RESTORE, STAGED};
        let sel = RESTORE | STAGED | HOST_OFFLOADS | traffic::bits(traffic::SMALL);
        let mut b = NetBuilder::new(sel).event_idx();
        for len in [60, 1514, 300, 64] {
            b.tx(csum_hdr(0, 0), &out_frame(len), 2);
        }
        b.rx(8, &[1538]);
        b.finish()
    }

    /// Every `fuzz_net` seed.
    pub fn fuzz_net() -> Vec<Seed> {
        use crate::net::Outcome;
        let seed = |name, bytes, rx_used, tx_used, outcome| Seed {
            name,
            bytes,
            expect: Expect::Net {
                rx_used,
                tx_used,
                outcome,
            },
        };
        vec![
            seed(
                "basic",
                net_basic(),
                4,
                3,
                Outcome {
                    tx_frames: 3,
                    rx_frames: 4,
                    ..Outcome::default()
                },
            ),
            seed(
                "offloads_mergeable",
                net_offloads_mergeable(),
                32,
                3,
                Outcome {
                    tx_frames: 3,
                    rx_frames: 8,
                    rx_dropped: 4,
                    ..Outcome::default()
                },
            ),
            seed(
                "rx_stall_and_resume",
                net_rx_stall_and_resume(),
                4,
                4,
                Outcome {
                    tx_frames: 4,
                    rx_frames: 4,
                    rx_stalls: 4,
                    ..Outcome::default()
                },
            ),
            seed(
                "extremes_mergeable",
                net_extremes_mergeable(),
                17,
                1,
                Outcome {
                    tx_frames: 1,
                    rx_frames: 1,
                    rx_dropped: 1,
                    rx_stalls: 3,
                    ..Outcome::default()
                },
            ),
            seed(
                "hostile",
                net_hostile(),
                8,
                9,
                Outcome {
                    tx_frames: 1,
                    tx_malformed: 8,
                    rx_frames: 4,
                    rx_dropped: 12,
                    rx_malformed: 4,
                    ..Outcome::default()
                },
            ),
            seed(
                "input_frames",
                net_input_frames(),
                8,
                1,
                Outcome {
                    tx_frames: 1,
                    rx_frames: 8,
                    rx_dropped: 8,
                    ..Outcome::default()
                },
            ),
            seed(
                "closed",
                net_closed(),
                0,
                2,
                Outcome {
                    tx_errors: 2,
                    ..Outcome::default()
                },
            ),
            seed(
                "restore",
                net_restore(),
                4,
                4,
                Outcome {
                    tx_frames: 4,
                    rx_frames: 4,
                    ..Outcome::default()
                },
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_devices::GuestMemoryMmap;
    use vm_memory::{Bytes, GuestAddress};

    type Runner = fn(&[u8]) -> GuestMemoryMmap;

    fn targets() -> Vec<(&'static str, Vec<seeds::Seed>, Runner)> {
        vec![
            (
                "fuzz_block",
                seeds::fuzz_block(),
                block::run_and_return_memory,
            ),
            (
                "fuzz_vsock",
                seeds::fuzz_vsock(),
                vsock::run_and_return_memory,
            ),
            ("fuzz_net", seeds::fuzz_net(), net::run_and_return_memory),
        ]
    }

    fn corpus(target: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("corpus")
            .join(target)
    }

    /// The committed seeds equal what [`seeds`] generates (`EMBER_FUZZ_WRITE_SEEDS=1` rewrites
    /// them) and do what they were made for.
    #[test]
    fn seeds_are_current_and_valid() {
        let write = std::env::var_os("EMBER_FUZZ_WRITE_SEEDS").is_some();
        for (target, seeds, run) in targets() {
            let dir = corpus(target);
            for seed in seeds {
                let name = seed.name;
                let path = dir.join(name);
                if write {
                    std::fs::create_dir_all(&dir).unwrap();
                    std::fs::write(&path, &seed.bytes).unwrap();
                }
                let committed = std::fs::read(&path).unwrap_or_default();
                assert!(
                    committed == seed.bytes,
                    "{target} seed {name} is stale: EMBER_FUZZ_WRITE_SEEDS=1"
                );
                let mem = run(&seed.bytes);
                match seed.expect {
                    seeds::Expect::BlockStatuses(statuses) => {
                        assert_eq!(queue::used_idx(&mem, 0) as usize, statuses.len(), "{name}");
                        for (k, want) in statuses.into_iter().enumerate() {
                            let got: u8 =
                                mem.read_obj(GuestAddress(seeds::status_addr(k))).unwrap();
                            assert_eq!(got, want, "{target} seed {name}: request {k}");
                        }
                    }
                    seeds::Expect::TxConsumed(n) => {
                        assert_eq!(queue::used_idx(&mem, 1), n, "{target} seed {name}: tx");
                    }
                    seeds::Expect::Net {
                        rx_used,
                        tx_used,
                        outcome,
                    } => {
                        let used = (queue::used_idx(&mem, 0), queue::used_idx(&mem, 1));
                        assert_eq!(used, (rx_used, tx_used), "{target} seed {name}: rx, tx");
                        let (_, got) = net::run_and_return_outcome(&seed.bytes);
                        assert_eq!(got, outcome, "{target} seed {name}");
                    }
                }
            }
        }
    }

    /// Replays every file under `corpus/` (seeds and whatever fuzzing added) on stable.
    #[test]
    fn corpus_replays_without_crashing() {
        for (target, _, run) in targets() {
            let mut n = 0;
            if let Ok(entries) = std::fs::read_dir(corpus(target)) {
                for e in entries.flatten() {
                    run(&std::fs::read(e.path()).unwrap());
                    n += 1;
                }
            }
            assert!(n > 0, "no corpus for {target}");
        }
    }
}

//! Moving frames between the virtqueues and the TAP: transmit chains are checked and gathered
//! without a copy; received frames are copied into the guest's receive buffers. Everything here
//! works on descriptor chains a hostile guest wrote, so every length is bounded and every error
//! is a value, never a panic.

use std::io::Write;

use virtio_bindings::bindings::virtio_net as vn;
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT, Writer};
use vm_memory::{GuestMemory, Permissions, VolatileSlice};

use super::features;
use super::tap::VNET_HDR_LEN;
use crate::GuestMemoryMmap;

/// Ethernet header length: the shortest frame the TAP accepts.
pub const ETH_HLEN: usize = 14;
/// Largest frame (after the vnet header) moved either way: a 64 KiB GSO packet plus Ethernet and
/// VLAN headers. Larger transmit chains are refused; larger received frames are dropped.
pub const MAX_FRAME_LEN: usize = 65_536 + ETH_HLEN + 4;
/// Most descriptors one chain may have. Without indirect tables a chain cannot be longer than
/// the queue; with them, the Linux driver uses at most `MAX_SKB_FRAGS + 2`.
pub const MAX_CHAIN_DESCS: usize = 256;

const F_NEEDS_CSUM: u8 = vn::VIRTIO_NET_HDR_F_NEEDS_CSUM as u8;
const F_DATA_VALID: u8 = vn::VIRTIO_NET_HDR_F_DATA_VALID as u8;
const GSO_NONE: u8 = vn::VIRTIO_NET_HDR_GSO_NONE as u8;
const GSO_TCPV4: u8 = vn::VIRTIO_NET_HDR_GSO_TCPV4 as u8;
const GSO_TCPV6: u8 = vn::VIRTIO_NET_HDR_GSO_TCPV6 as u8;
const GSO_ECN: u8 = vn::VIRTIO_NET_HDR_GSO_ECN as u8;
/// Offset of `num_buffers` in `virtio_net_hdr_v1`.
const NUM_BUFFERS_OFF: usize = 10;

/// Why a chain was refused (it is completed with length 0 and counted).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// A transmit chain contains a device-writable descriptor.
    #[error("transmit chain has a device-writable descriptor")]
    WritableInTx,
    /// A receive chain contains a device-readable descriptor.
    #[error("receive chain has a device-readable descriptor")]
    ReadableInRx,
    /// More than [`MAX_CHAIN_DESCS`] descriptors.
    #[error("chain has more than {MAX_CHAIN_DESCS} descriptors")]
    TooManyDescriptors,
    /// The transmit chain is larger than a header plus [`MAX_FRAME_LEN`].
    #[error("transmit chain is longer than {} bytes", VNET_HDR_LEN + MAX_FRAME_LEN)]
    TooLong,
    /// Shorter than a vnet header plus an Ethernet header.
    #[error("chain is too short for a vnet header and an Ethernet header")]
    TooShort,
    /// A descriptor points outside guest memory.
    #[error("descriptor outside guest memory")]
    Memory,
    /// A receive chain has no room at all.
    #[error("receive chain has no writable bytes")]
    Empty,
    /// The header asks for an offload the driver did not negotiate, or an unknown GSO type.
    #[error("vnet header asks for {0}, which was not negotiated")]
    Offload(&'static str),
}

/// A transmit frame ready for `writev`: a checked copy of the header, the body in guest memory.
#[derive(Debug)]
pub struct TxFrame<'a> {
    /// The sanitised vnet header.
    pub hdr: [u8; VNET_HDR_LEN],
    /// The frame, as slices of guest memory.
    pub body: Vec<VolatileSlice<'a, crate::GuestBitmapSlice<'a>>>,
    /// Length of the frame (without the header).
    pub len: usize,
}

/// Walks a transmit chain: device-readable descriptors only, bounded count and size, every
/// buffer inside guest memory. The header is copied out (so the guest cannot change it between
/// the check and the write) and checked against the negotiated `acked` features.
pub fn gather_tx<'a>(
    mem: &'a GuestMemoryMmap,
    chain: DescriptorChain<&'a GuestMemoryMmap>,
    acked: u64,
) -> Result<TxFrame<'a>, ChainError> {
    let mut hdr = [0u8; VNET_HDR_LEN];
    let mut got_hdr = 0;
    let mut body = Vec::new();
    let mut total = 0usize;
    for (i, desc) in chain.enumerate() {
        if i >= MAX_CHAIN_DESCS {
            return Err(ChainError::TooManyDescriptors);
        }
        if desc.is_write_only() {
            return Err(ChainError::WritableInTx);
        }
        let len = desc.len() as usize;
        total = total
            .checked_add(len)
            .filter(|&t| t <= VNET_HDR_LEN + MAX_FRAME_LEN)
            .ok_or(ChainError::TooLong)?;
        if len == 0 {
            continue;
        }
        let slices = mem
            .get_slices(desc.addr(), len, Permissions::Read)
            .map_err(|_| ChainError::Memory)?;
        for s in slices {
            let mut s = s.map_err(|_| ChainError::Memory)?;
            if got_hdr < VNET_HDR_LEN {
                let n = (VNET_HDR_LEN - got_hdr).min(s.len());
                s.copy_to(&mut hdr[got_hdr..got_hdr + n]);
                got_hdr += n;
                s = s.offset(n).map_err(|_| ChainError::Memory)?;
            }
            if !s.is_empty() {
                body.push(s);
            }
        }
    }
    if total < VNET_HDR_LEN + ETH_HLEN {
        return Err(ChainError::TooShort);
    }
    sanitize_tx_header(&mut hdr, acked)?;
    Ok(TxFrame {
        hdr,
        body,
        len: total - VNET_HDR_LEN,
    })
}

/// Checks a transmit header against the negotiated features and clears what the driver must
/// not set (`DATA_VALID`, `RSC_INFO`, `num_buffers`).
pub fn sanitize_tx_header(hdr: &mut [u8; VNET_HDR_LEN], acked: u64) -> Result<(), ChainError> {
    let flags = hdr[0] & F_NEEDS_CSUM;
    if flags != 0 && acked & features::CSUM == 0 {
        return Err(ChainError::Offload("checksum offload (VIRTIO_NET_F_CSUM)"));
    }
    let gso = hdr[1];
    let needed = match gso & !GSO_ECN {
        GSO_NONE if gso == GSO_NONE => None,
        GSO_TCPV4 => Some((features::HOST_TSO4, "TCPv4 segmentation (HOST_TSO4)")),
        GSO_TCPV6 => Some((features::HOST_TSO6, "TCPv6 segmentation (HOST_TSO6)")),
        _ => return Err(ChainError::Offload("an unsupported GSO type")),
    };
    if let Some((f, what)) = needed {
        if acked & f == 0 {
            return Err(ChainError::Offload(what));
        }
        if gso & GSO_ECN != 0 && acked & features::HOST_ECN == 0 {
            return Err(ChainError::Offload("ECN segmentation (HOST_ECN)"));
        }
    }
    hdr[0] = flags;
    hdr[NUM_BUFFERS_OFF..].fill(0);
    Ok(())
}

/// Makes a header the TAP produced fit the features the driver accepted; `false` when the frame
/// uses an offload the driver cannot take (it must be dropped; cannot happen while the TAP's
/// offload settings follow the features).
pub fn fix_rx_header(hdr: &mut [u8], acked: u64) -> bool {
    if hdr.len() < VNET_HDR_LEN {
        return false;
    }
    if acked & features::GUEST_CSUM == 0 {
        if hdr[0] & F_NEEDS_CSUM != 0 {
            return false;
        }
        // The spec wants flags zero without GUEST_CSUM (DATA_VALID is only a hint).
        hdr[0] = 0;
    } else {
        hdr[0] &= F_NEEDS_CSUM | F_DATA_VALID;
    }
    let gso = hdr[1];
    let ok = match gso & !GSO_ECN {
        GSO_NONE => gso == GSO_NONE,
        GSO_TCPV4 => acked & features::GUEST_TSO4 != 0,
        GSO_TCPV6 => acked & features::GUEST_TSO6 != 0,
        _ => false,
    };
    ok && (gso & GSO_ECN == 0 || acked & features::GUEST_ECN != 0)
}

/// What happened to a received frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// In the guest's buffers, completed on the used ring.
    Delivered,
    /// Not enough receive buffers; none were consumed. Notifications are enabled, so the driver
    /// will kick the queue when it adds buffers: keep the frame until then.
    NoBuffers,
    /// More buffers arrived while notifications were being enabled: try again now.
    Retry,
    /// The frame can never fit the buffers the driver provides; they were given back untouched
    /// and the frame must be dropped.
    TooBig,
}

/// A validated receive chain: its head and a writer over its (device-writable) buffers.
fn rx_writer<'a>(
    mem: &'a GuestMemoryMmap,
    chain: DescriptorChain<&'a GuestMemoryMmap>,
) -> Result<Writer<'a, crate::GuestBitmapSlice<'a>>, ChainError> {
    for (i, desc) in chain.clone().enumerate() {
        if i >= MAX_CHAIN_DESCS {
            return Err(ChainError::TooManyDescriptors);
        }
        if !desc.is_write_only() {
            return Err(ChainError::ReadableInRx);
        }
    }
    let w = chain.writer(mem).map_err(|_| ChainError::Memory)?;
    if w.available_bytes() == 0 {
        return Err(ChainError::Empty);
    }
    Ok(w)
}

/// Copies `frame` (vnet header first) into the receive queue.
///
/// Without `mergeable`, the frame must fit one chain; with it (`VIRTIO_NET_F_MRG_RXBUF`), it
/// spreads over as many chains as needed and `num_buffers` says how many. Chains are only
/// consumed once the whole frame fits: when buffers run short, the queue's position is put back
/// and notifications are enabled at the position examined so far. Malformed chains are
/// completed with length 0 (together with any chains already gathered for this frame, whose
/// order could not be kept otherwise) and counted in `malformed`.
pub fn deliver_rx(
    q: &mut Queue,
    mem: &GuestMemoryMmap,
    frame: &mut [u8],
    mergeable: bool,
    malformed: &mut u64,
) -> Result<Delivery, virtio_queue::Error> {
    let len = frame.len();
    if len < VNET_HDR_LEN {
        return Ok(Delivery::TooBig);
    }
    let max_parts = if mergeable { usize::from(q.size()) } else { 1 };
    let mut rewind_to = q.next_avail();
    let mut parts: Vec<(u16, Writer<'_, crate::GuestBitmapSlice<'_>>)> = Vec::new();
    let mut have = 0usize;
    while have < len {
        if parts.len() >= max_parts {
            q.set_next_avail(rewind_to);
            return Ok(Delivery::TooBig);
        }
        let next = q.iter(mem)?.next();
        let Some(chain) = next else {
            // Publish "kick me" at the position examined so far, then give the buffers back.
            let more = q.enable_notification(mem)?;
            q.set_next_avail(rewind_to);
            return Ok(if more {
                Delivery::Retry
            } else {
                Delivery::NoBuffers
            });
        };
        let head = chain.head_index();
        match rx_writer(mem, chain) {
            Ok(w) if !parts.is_empty() || w.available_bytes() >= VNET_HDR_LEN => {
                have = have.saturating_add(w.available_bytes());
                parts.push((head, w));
            }
            bad => {
                crate::debug_limited!("virtio-net: bad receive chain {head}: {:?}", bad.err());
                for (h, _) in parts.drain(..) {
                    q.add_used(mem, h, 0)?;
                }
                q.add_used(mem, head, 0)?;
                *malformed += 1;
                have = 0;
                rewind_to = q.next_avail();
            }
        }
    }
    let count = u16::try_from(parts.len()).unwrap_or(u16::MAX);
    frame[NUM_BUFFERS_OFF..VNET_HDR_LEN].copy_from_slice(&count.to_le_bytes());
    let mut off = 0;
    for (head, mut w) in parts {
        let take = w.available_bytes().min(len - off);
        let written = match w.write_all(&frame[off..off + take]) {
            Ok(()) => take,
            Err(_) => {
                *malformed += 1;
                0
            }
        };
        q.add_used(mem, head, written as u32)?;
        off += take;
    }
    Ok(Delivery::Delivered)
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Address, Bytes, GuestAddress};

    const NEXT: u16 = 1;
    const WRITE: u16 = 2;
    const INDIRECT: u16 = 4;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap()
    }

    /// Lays out chains (each a list of (addr, len, flags) without NEXT) in a fresh queue.
    fn queue_with(m: &GuestMemoryMmap, chains: &[&[(u64, u32, u16)]]) -> (Queue, GuestAddress) {
        let mock = MockSplitQueue::new(m, 16);
        let mut raw = Vec::new();
        for chain in chains {
            for (j, &(addr, len, flags)) in chain.iter().enumerate() {
                let last = j + 1 == chain.len();
                let idx = raw.len() as u16;
                let (flags, next) = if last {
                    (flags, 0)
                } else {
                    (flags | NEXT, idx + 1)
                };
                raw.push(RawDescriptor::from(SplitDescriptor::new(
                    addr, len, flags, next,
                )));
            }
        }
        mock.add_desc_chains(&raw, 0).unwrap();
        (mock.create_queue().unwrap(), mock.used_addr())
    }

    fn used(m: &GuestMemoryMmap, used_ring: GuestAddress, i: u64) -> (u32, u32) {
        let id: u32 = m.read_obj(used_ring.unchecked_add(4 + 8 * i)).unwrap();
        let len: u32 = m.read_obj(used_ring.unchecked_add(8 + 8 * i)).unwrap();
        (id, len)
    }

    fn pop<'a>(q: &mut Queue, m: &'a GuestMemoryMmap) -> DescriptorChain<&'a GuestMemoryMmap> {
        q.iter(m).unwrap().next().unwrap()
    }

    const ALL: u64 = features::CSUM
        | features::HOST_TSO4
        | features::HOST_TSO6
        | features::HOST_ECN
        | features::GUEST_CSUM
        | features::GUEST_TSO4
        | features::GUEST_TSO6
        | features::GUEST_ECN;

    #[test]
    fn tx_gathers_split_header_and_body() {
        let m = mem();
        let mut frame = [0u8; 100];
        frame[0] = F_NEEDS_CSUM | F_DATA_VALID;
        frame[10] = 7; // num_buffers: must be cleared
        for (i, b) in frame[12..].iter_mut().enumerate() {
            *b = i as u8;
        }
        m.write_slice(&frame[..5], GuestAddress(0x10000)).unwrap();
        m.write_slice(&frame[5..40], GuestAddress(0x20000)).unwrap();
        m.write_slice(&frame[40..], GuestAddress(0x30000)).unwrap();
        let (mut q, _) = queue_with(
            &m,
            &[&[(0x10000, 5, 0), (0x20000, 35, 0), (0x30000, 60, 0)]],
        );
        let f = gather_tx(&m, pop(&mut q, &m), ALL).unwrap();
        assert_eq!(f.len, 88);
        assert_eq!(f.hdr[0], F_NEEDS_CSUM);
        assert_eq!(&f.hdr[10..], &[0, 0]);
        let mut body = Vec::new();
        for s in &f.body {
            let mut v = vec![0u8; s.len()];
            s.copy_to(&mut v[..]);
            body.extend(v);
        }
        assert_eq!(body, frame[12..]);
    }

    #[test]
    fn tx_refuses_hostile_chains() {
        let m = mem();
        type Chain = Vec<(u64, u32, u16)>;
        let cases: Vec<(Chain, ChainError)> = vec![
            (
                vec![(0x10000, 100, 0), (0x20000, 10, WRITE)],
                ChainError::WritableInTx,
            ),
            (vec![(0x10000, 20, 0)], ChainError::TooShort),
            (vec![(0x10000, 10, 0)], ChainError::TooShort),
            (
                vec![(0x10000, 0x10000, 0), (0x20000, 0x1000, 0)],
                ChainError::TooLong,
            ),
            (vec![(0x10000, u32::MAX, 0)], ChainError::TooLong),
            (vec![(0x3f_ff00, 0x200, 0)], ChainError::Memory),
            (vec![(0xffff_ffff_ffff_0000, 100, 0)], ChainError::Memory),
        ];
        for (chain, want) in cases {
            let (mut q, _) = queue_with(&m, &[&chain]);
            let got = gather_tx(&m, pop(&mut q, &m), ALL).unwrap_err();
            assert_eq!(got, want, "{chain:?}");
        }
    }

    #[test]
    fn tx_refuses_overlong_indirect_chain() {
        let m = mem();
        // An indirect table of 300 one-byte descriptors.
        let table = 0x10_0000u64;
        for i in 0..300u16 {
            let flags = if i < 299 { NEXT } else { 0 };
            let d = RawDescriptor::from(SplitDescriptor::new(0x20000, 1, flags, i + 1));
            m.write_obj(d, GuestAddress(table + 16 * u64::from(i)))
                .unwrap();
        }
        let (mut q, _) = queue_with(&m, &[&[(table, 300 * 16, INDIRECT)]]);
        assert_eq!(
            gather_tx(&m, pop(&mut q, &m), ALL).unwrap_err(),
            ChainError::TooManyDescriptors
        );
    }

    #[test]
    fn tx_header_offloads_must_be_negotiated() {
        let hdr = |flags: u8, gso: u8| {
            let mut h = [0u8; VNET_HDR_LEN];
            h[0] = flags;
            h[1] = gso;
            h
        };
        assert!(sanitize_tx_header(&mut hdr(0, 0), 0).is_ok());
        assert!(sanitize_tx_header(&mut hdr(F_NEEDS_CSUM, 0), 0).is_err());
        assert!(sanitize_tx_header(&mut hdr(F_NEEDS_CSUM, 0), features::CSUM).is_ok());
        assert!(sanitize_tx_header(&mut hdr(F_NEEDS_CSUM, GSO_TCPV4), features::CSUM).is_err());
        let tso = features::CSUM | features::HOST_TSO4 | features::HOST_TSO6;
        assert!(sanitize_tx_header(&mut hdr(F_NEEDS_CSUM, GSO_TCPV4), tso).is_ok());
        assert!(sanitize_tx_header(&mut hdr(F_NEEDS_CSUM, GSO_TCPV6), tso).is_ok());
        assert!(sanitize_tx_header(&mut hdr(F_NEEDS_CSUM, GSO_TCPV4 | GSO_ECN), tso).is_err());
        let ecn = tso | features::HOST_ECN;
        assert!(sanitize_tx_header(&mut hdr(F_NEEDS_CSUM, GSO_TCPV4 | GSO_ECN), ecn).is_ok());
        assert!(sanitize_tx_header(&mut hdr(0, GSO_ECN), ecn).is_err());
        assert!(sanitize_tx_header(&mut hdr(0, 3), ecn).is_err()); // UFO
        assert!(sanitize_tx_header(&mut hdr(0, 5), ecn).is_err()); // USO
    }

    #[test]
    fn rx_header_follows_guest_features() {
        let mut h = [F_DATA_VALID, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        assert!(fix_rx_header(&mut h, 0));
        assert_eq!(h[0], 0);
        let mut h = [F_NEEDS_CSUM, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        assert!(!fix_rx_header(&mut h, 0));
        assert!(fix_rx_header(&mut h, features::GUEST_CSUM));
        assert_eq!(h[0], F_NEEDS_CSUM);
        let mut h = [F_NEEDS_CSUM, GSO_TCPV4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        assert!(!fix_rx_header(&mut h, features::GUEST_CSUM));
        assert!(fix_rx_header(
            &mut h,
            features::GUEST_CSUM | features::GUEST_TSO4
        ));
        h[1] = GSO_TCPV6 | GSO_ECN;
        assert!(!fix_rx_header(
            &mut h,
            features::GUEST_CSUM | features::GUEST_TSO6
        ));
        assert!(fix_rx_header(&mut h, ALL));
        assert!(!fix_rx_header(&mut [0u8; 4], ALL));
    }

    fn frame(len: usize) -> Vec<u8> {
        let mut f: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        f[..VNET_HDR_LEN].fill(0);
        f
    }

    #[test]
    fn rx_single_buffer() {
        let m = mem();
        let (mut q, used_ring) = queue_with(&m, &[&[(0x10000, 2000, WRITE)]]);
        let mut f = frame(1000);
        let mut bad = 0;
        assert_eq!(
            deliver_rx(&mut q, &m, &mut f, false, &mut bad),
            Ok(Delivery::Delivered)
        );
        assert_eq!(used(&m, used_ring, 0), (0, 1000));
        let mut got = vec![0u8; 1000];
        m.read_slice(&mut got, GuestAddress(0x10000)).unwrap();
        assert_eq!(&got[10..12], &[1, 0]);
        assert_eq!(got[12..], f[12..]);
        // Nothing left: the frame waits, nothing is consumed.
        let before = q.next_avail();
        assert_eq!(
            deliver_rx(&mut q, &m, &mut f, false, &mut bad),
            Ok(Delivery::NoBuffers)
        );
        assert_eq!(q.next_avail(), before);
        assert_eq!(bad, 0);
    }

    #[test]
    fn rx_small_buffer_without_mergeable_is_given_back() {
        let m = mem();
        let (mut q, _) = queue_with(&m, &[&[(0x10000, 100, WRITE)]]);
        let mut bad = 0;
        assert_eq!(
            deliver_rx(&mut q, &m, &mut frame(1000), false, &mut bad),
            Ok(Delivery::TooBig)
        );
        assert_eq!(q.next_avail(), 0);
        // A frame that fits still goes there.
        assert_eq!(
            deliver_rx(&mut q, &m, &mut frame(60), false, &mut bad),
            Ok(Delivery::Delivered)
        );
    }

    #[test]
    fn rx_mergeable_spreads_over_buffers() {
        let m = mem();
        let (mut q, used_ring) = queue_with(
            &m,
            &[
                &[(0x10000, 1500, WRITE)],
                &[(0x20000, 1500, WRITE)],
                &[(0x30000, 1500, WRITE)],
            ],
        );
        let mut f = frame(3200);
        let mut bad = 0;
        assert_eq!(
            deliver_rx(&mut q, &m, &mut f, true, &mut bad),
            Ok(Delivery::Delivered)
        );
        assert_eq!(used(&m, used_ring, 0), (0, 1500));
        assert_eq!(used(&m, used_ring, 1), (1, 1500));
        assert_eq!(used(&m, used_ring, 2), (2, 200));
        let mut got = vec![0u8; 3200];
        m.read_slice(&mut got[..1500], GuestAddress(0x10000))
            .unwrap();
        m.read_slice(&mut got[1500..3000], GuestAddress(0x20000))
            .unwrap();
        m.read_slice(&mut got[3000..], GuestAddress(0x30000))
            .unwrap();
        assert_eq!(&got[10..12], &[3, 0]);
        assert_eq!(got[12..], f[12..]);
    }

    #[test]
    fn rx_mergeable_shortage_consumes_nothing() {
        let m = mem();
        let (mut q, _) = queue_with(&m, &[&[(0x10000, 1500, WRITE)], &[(0x20000, 1500, WRITE)]]);
        let mut bad = 0;
        assert_eq!(
            deliver_rx(&mut q, &m, &mut frame(5000), true, &mut bad),
            Ok(Delivery::NoBuffers)
        );
        assert_eq!(q.next_avail(), 0);
        assert_eq!(
            deliver_rx(&mut q, &m, &mut frame(2000), true, &mut bad),
            Ok(Delivery::Delivered)
        );
        assert_eq!(q.next_avail(), 2);
    }

    #[test]
    fn rx_shortage_asks_for_a_kick_past_the_examined_buffers() {
        // With EVENT_IDX, the driver only kicks when its avail index passes `avail_event`: it
        // must point past the buffers already seen, not at the rewound position, or the driver
        // adding one more buffer would never kick.
        let m = mem();
        let (mut q, used_ring) =
            queue_with(&m, &[&[(0x10000, 1500, WRITE)], &[(0x20000, 1500, WRITE)]]);
        q.set_event_idx(true);
        let mut bad = 0;
        assert_eq!(
            deliver_rx(&mut q, &m, &mut frame(5000), true, &mut bad),
            Ok(Delivery::NoBuffers)
        );
        let avail_event: u16 = m.read_obj(used_ring.unchecked_add(4 + 8 * 16)).unwrap();
        assert_eq!((q.next_avail(), avail_event), (0, 2));
    }

    #[test]
    fn rx_mergeable_frame_larger_than_the_whole_ring_is_dropped() {
        let m = mem();
        let chains: Vec<[(u64, u32, u16); 1]> = (0..16u64)
            .map(|i| [(0x10000 + 0x1000 * i, 100, WRITE)])
            .collect();
        let refs: Vec<&[(u64, u32, u16)]> = chains.iter().map(|c| &c[..]).collect();
        let (mut q, _) = queue_with(&m, &refs);
        let mut bad = 0;
        assert_eq!(
            deliver_rx(&mut q, &m, &mut frame(5000), true, &mut bad),
            Ok(Delivery::TooBig)
        );
        assert_eq!(q.next_avail(), 0, "buffers given back untouched");
        assert_eq!(
            deliver_rx(&mut q, &m, &mut frame(1000), true, &mut bad),
            Ok(Delivery::Delivered)
        );
        assert_eq!(q.next_avail(), 10);
    }

    #[test]
    fn rx_malformed_chains_are_completed_empty() {
        let m = mem();
        let (mut q, used_ring) = queue_with(
            &m,
            &[
                &[(0x10000, 100, 0)],         // device-readable
                &[(0x3f_ff00, 0x200, WRITE)], // outside memory
                &[(0x10000, 0, WRITE)],       // empty
                &[(0x10000, 4, WRITE)],       // cannot hold the header
                &[(0x20000, 1500, WRITE)],
            ],
        );
        let mut bad = 0;
        assert_eq!(
            deliver_rx(&mut q, &m, &mut frame(100), false, &mut bad),
            Ok(Delivery::Delivered)
        );
        assert_eq!(bad, 4);
        for i in 0..4 {
            assert_eq!(used(&m, used_ring, i), (i as u32, 0));
        }
        assert_eq!(used(&m, used_ring, 4), (4, 100));
    }
}

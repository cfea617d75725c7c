//! Guest memory and split virtqueues built from fuzz input: the part every virtio device target
//! shares.
//!
//! Input layout (missing bytes read as zero, so every input is valid):
//!
//! | bytes | meaning |
//! |---|---|
//! | 1 | `selector`: left to the target (mode, features, ...) |
//! | per queue | a [`VirtqInput`], for as many queues as the device has |
//! | rest | payload, copied to guest memory at [`PAYLOAD`] (request headers, packets, data, indirect tables) |
//!
//! One queue's part:
//!
//! | bytes | meaning |
//! |---|---|
//! | 1 | queue size: `1 << (b % 9)` (1..=256), capped at the device's maximum |
//! | 1 | flags: bit 0 `VIRTIO_RING_F_EVENT_IDX`, bit 1 raw avail index (next 2 bytes) |
//! | 2 | raw avail index (only with flag bit 1; otherwise the number of avail entries) |
//! | 1 | `n`: descriptors, at most the queue size |
//! | 16 × n | descriptors: addr (le64, taken modulo `MEM_SIZE + 4 KiB`, so a few fall outside guest memory), len (le32, modulo `2 × MEM_SIZE`), flags (le16), next (le16) |
//! | 1 | `m`: avail ring entries |
//! | 2 × m | avail ring entries (le16 descriptor heads, unchecked) |
//!
//! Guest memory is [`MEM_SIZE`] bytes; queue `q`'s descriptor table, avail ring and used ring
//! are at [`desc_table`]`(q)`, [`avail_ring`]`(q)`, [`used_ring`]`(q)` (4 KiB apart), for up to
//! [`MAX_QUEUES`] queues; the payload starts at [`PAYLOAD`].

use ember_devices::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};

/// Guest memory size.
pub const MEM_SIZE: u64 = 0x5_0000;
/// Queues that fit below [`PAYLOAD`].
pub const MAX_QUEUES: usize = 5;
/// Where the payload lands.
pub const PAYLOAD: u64 = 0x1_0000;

/// Descriptor table of queue `q` (room for 256 descriptors).
pub const fn desc_table(q: usize) -> u64 {
    q as u64 * 0x3000
}
/// Available ring of queue `q`.
pub const fn avail_ring(q: usize) -> u64 {
    q as u64 * 0x3000 + 0x1000
}
/// Used ring of queue `q`.
pub const fn used_ring(q: usize) -> u64 {
    q as u64 * 0x3000 + 0x2000
}

/// `VIRTQ_DESC_F_NEXT`.
pub const F_NEXT: u16 = 1;
/// `VIRTQ_DESC_F_WRITE`.
pub const F_WRITE: u16 = 2;
/// `VIRTQ_DESC_F_INDIRECT`.
pub const F_INDIRECT: u16 = 4;

/// One descriptor as the guest writes it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Desc {
    /// Buffer address.
    pub addr: u64,
    /// Buffer length.
    pub len: u32,
    /// `F_*` flags.
    pub flags: u16,
    /// Next descriptor index (with `F_NEXT`).
    pub next: u16,
}

/// One virtqueue as the guest set it up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VirtqInput {
    /// Queue size (power of two).
    pub queue_size: u16,
    /// Whether `VIRTIO_RING_F_EVENT_IDX` applies.
    pub event_idx: bool,
    /// The avail ring's `idx` field.
    pub avail_idx: u16,
    /// The descriptor table.
    pub descs: Vec<Desc>,
    /// The avail ring entries.
    pub avail: Vec<u16>,
}

/// A parsed fuzz input.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FuzzInput {
    /// Target-specific choices.
    pub selector: u8,
    /// The device's queues, in order.
    pub queues: Vec<VirtqInput>,
    /// Bytes copied to guest memory at [`PAYLOAD`].
    pub payload: Vec<u8>,
}

struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let n = N.min(self.0.len());
        out[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        out
    }
    fn u8(&mut self) -> u8 {
        self.bytes::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.bytes())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes())
    }
}

impl VirtqInput {
    fn parse(c: &mut Cursor<'_>, max_size: u16) -> Self {
        let queue_size = (1u16 << (c.u8() % 9)).min(max_size.max(1));
        let flags = c.u8();
        let raw_idx = c.u16();
        let n = usize::from(c.u8()).min(usize::from(queue_size));
        let descs = (0..n)
            .map(|_| Desc {
                addr: c.u64() % (MEM_SIZE + 0x1000),
                len: (u64::from(c.u32()) % (2 * MEM_SIZE)) as u32,
                flags: c.u16(),
                next: c.u16(),
            })
            .collect();
        let m = usize::from(c.u8());
        let avail: Vec<u16> = (0..m).map(|_| c.u16()).collect();
        VirtqInput {
            queue_size,
            event_idx: flags & 1 != 0,
            avail_idx: if flags & 2 != 0 { raw_idx } else { m as u16 },
            descs,
            avail,
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        let raw_idx = self.avail_idx as usize != self.avail.len();
        out.push(self.queue_size.max(1).trailing_zeros() as u8);
        out.push(u8::from(self.event_idx) | (u8::from(raw_idx) << 1));
        out.extend_from_slice(&self.avail_idx.to_le_bytes());
        out.push(self.descs.len() as u8);
        for d in &self.descs {
            out.extend_from_slice(&d.addr.to_le_bytes());
            out.extend_from_slice(&d.len.to_le_bytes());
            out.extend_from_slice(&d.flags.to_le_bytes());
            out.extend_from_slice(&d.next.to_le_bytes());
        }
        out.push(self.avail.len() as u8);
        for a in &self.avail {
            out.extend_from_slice(&a.to_le_bytes());
        }
    }

    /// Appends a chain of `(addr, len, flags)` buffers (`F_NEXT` and `next` filled in) and makes
    /// it available; returns its head.
    pub fn push_chain(&mut self, bufs: &[(u64, u32, u16)]) -> u16 {
        let head = self.descs.len() as u16;
        for (i, &(addr, len, flags)) in bufs.iter().enumerate() {
            let last = i + 1 == bufs.len();
            self.descs.push(Desc {
                addr,
                len,
                flags: flags | if last { 0 } else { F_NEXT },
                next: if last { 0 } else { head + i as u16 + 1 },
            });
        }
        self.avail.push(head);
        self.avail_idx = self.avail.len() as u16;
        head
    }
}

impl FuzzInput {
    /// Parses `data` for a device whose queues have the maximum sizes `max_sizes` (at most
    /// [`MAX_QUEUES`] of them).
    pub fn parse(data: &[u8], max_sizes: &[u16]) -> Self {
        let mut c = Cursor(data);
        let selector = c.u8();
        let queues = max_sizes
            .iter()
            .take(MAX_QUEUES)
            .map(|&max| VirtqInput::parse(&mut c, max))
            .collect();
        let payload_len = c.0.len().min((MEM_SIZE - PAYLOAD) as usize);
        FuzzInput {
            selector,
            queues,
            payload: c.0[..payload_len].to_vec(),
        }
    }

    /// The inverse of [`FuzzInput::parse`] (for hand-made seeds). Addresses and lengths must
    /// already be in the ranges `parse` produces.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![self.selector];
        for q in &self.queues {
            q.encode(&mut out);
        }
        out.extend_from_slice(&self.payload);
        out
    }

    /// Writes `bytes` into the payload at guest address `addr` (growing the payload).
    pub fn put(&mut self, addr: u64, bytes: &[u8]) {
        let Some(off) = addr.checked_sub(PAYLOAD).map(|o| o as usize) else {
            return;
        };
        let end = off + bytes.len();
        if self.payload.len() < end {
            self.payload.resize(end, 0);
        }
        self.payload[off..end].copy_from_slice(bytes);
    }

    /// Guest memory holding the descriptor tables, the avail rings and the payload.
    pub fn memory(&self) -> GuestMemoryMmap {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)])
            .expect("fuzz harness: cannot map guest memory");
        for (q, vq) in self.queues.iter().enumerate() {
            for (i, d) in vq.descs.iter().enumerate() {
                let mut raw = [0u8; 16];
                raw[..8].copy_from_slice(&d.addr.to_le_bytes());
                raw[8..12].copy_from_slice(&d.len.to_le_bytes());
                raw[12..14].copy_from_slice(&d.flags.to_le_bytes());
                raw[14..].copy_from_slice(&d.next.to_le_bytes());
                mem.write_slice(&raw, GuestAddress(desc_table(q) + 16 * i as u64))
                    .expect("fuzz harness: descriptor table inside memory");
            }
            // Avail ring: flags (0), idx, entries (at most 255, which fit below the used ring).
            mem.write_obj(vq.avail_idx.to_le(), GuestAddress(avail_ring(q) + 2))
                .expect("fuzz harness: avail ring inside memory");
            for (i, a) in vq.avail.iter().enumerate() {
                mem.write_obj(a.to_le(), GuestAddress(avail_ring(q) + 4 + 2 * i as u64))
                    .expect("fuzz harness: avail ring inside memory");
            }
        }
        mem.write_slice(&self.payload, GuestAddress(PAYLOAD))
            .expect("fuzz harness: payload inside memory");
        mem
    }

    /// Ready queues over the rings, as the transport hands them to a device at DRIVER_OK.
    pub fn virtqueues(&self, max_sizes: &[u16]) -> Vec<virtio_queue::Queue> {
        use virtio_queue::QueueT;
        self.queues
            .iter()
            .zip(max_sizes)
            .enumerate()
            .map(|(i, (vq, &max))| {
                let mut q = virtio_queue::Queue::new(max).expect("fuzz harness: max queue size");
                q.set_size(vq.queue_size);
                q.set_desc_table_address(Some(desc_table(i) as u32), Some(0));
                q.set_avail_ring_address(Some(avail_ring(i) as u32), Some(0));
                q.set_used_ring_address(Some(used_ring(i) as u32), Some(0));
                q.set_event_idx(vq.event_idx);
                q.set_ready(true);
                q
            })
            .collect()
    }
}

/// Queue `q`'s used ring `idx` after the device ran.
pub fn used_idx(mem: &GuestMemoryMmap, q: usize) -> u16 {
    mem.read_obj::<u16>(GuestAddress(used_ring(q) + 2))
        .map(u16::from_le)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_parse_round_trip() {
        let mut q = VirtqInput {
            queue_size: 16,
            event_idx: true,
            ..VirtqInput::default()
        };
        q.push_chain(&[(PAYLOAD, 16, 0), (PAYLOAD + 0x100, 1, F_WRITE)]);
        q.push_chain(&[(PAYLOAD + 0x200, 1, F_WRITE)]);
        let mut raw = q.clone();
        raw.avail_idx = 9;
        let input = FuzzInput {
            selector: 3,
            queues: vec![q, raw],
            payload: vec![1, 2, 3],
        };
        assert_eq!(FuzzInput::parse(&input.encode(), &[256, 256]), input);
    }

    #[test]
    fn short_and_empty_inputs_parse() {
        let f = FuzzInput::parse(&[], &[256, 16]);
        assert_eq!(f.queues.len(), 2);
        assert_eq!(f.queues[0].queue_size, 1);
        let f = FuzzInput::parse(&[0, 8, 0, 0, 0, 255], &[256]);
        assert_eq!(f.queues[0].queue_size, 256);
        assert_eq!(f.queues[0].descs.len(), 255);
        let _ = f.memory();
        let f = FuzzInput::parse(&[0, 8], &[16]);
        assert_eq!(f.queues[0].queue_size, 16);
    }
}

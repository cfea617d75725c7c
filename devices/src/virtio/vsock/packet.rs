//! The virtio-vsock packet header (virtio 1.2 §5.10.6) and the codes it carries.
//!
//! The header is 44 packed little-endian bytes; it is encoded and decoded field by field, so no
//! struct layout or host endianness is assumed.

/// The host's context id: packets from the guest must be addressed to it.
pub const VSOCK_HOST_CID: u64 = 2;

/// Length of `struct virtio_vsock_hdr`.
pub const HDR_LEN: usize = 44;

/// Largest payload of one packet, in either direction (Linux's `VIRTIO_VSOCK_MAX_PKT_BUF_SIZE`).
pub const MAX_PKT_PAYLOAD: usize = 64 * 1024;

/// `type`: stream socket (the only type this device speaks).
pub const TYPE_STREAM: u16 = 1;

/// Operation codes.
pub mod op {
    /// Connection request.
    pub const REQUEST: u16 = 1;
    /// Connection accepted.
    pub const RESPONSE: u16 = 2;
    /// Connection reset (refused or aborted).
    pub const RST: u16 = 3;
    /// One or both directions are shut down (see [`super::shutdown`]).
    pub const SHUTDOWN: u16 = 4;
    /// Data.
    pub const RW: u16 = 5;
    /// Credit information only.
    pub const CREDIT_UPDATE: u16 = 6;
    /// Asks the peer for a credit update.
    pub const CREDIT_REQUEST: u16 = 7;
}

/// `flags` of `OP_SHUTDOWN`.
pub mod shutdown {
    /// The sender will receive no more data.
    pub const RCV: u32 = 1;
    /// The sender will send no more data.
    pub const SEND: u32 = 2;
    /// Both.
    pub const BOTH: u32 = RCV | SEND;
}

/// `id` of the transport-reset event on the event queue.
pub const EVENT_TRANSPORT_RESET: u32 = 0;

/// A decoded packet header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Header {
    /// Source context id.
    pub src_cid: u64,
    /// Destination context id.
    pub dst_cid: u64,
    /// Source port.
    pub src_port: u32,
    /// Destination port.
    pub dst_port: u32,
    /// Payload length.
    pub len: u32,
    /// Socket type.
    pub kind: u16,
    /// Operation.
    pub op: u16,
    /// Operation flags.
    pub flags: u32,
    /// Sender's receive buffer size.
    pub buf_alloc: u32,
    /// Bytes the sender has consumed from its receive buffer, ever (wrapping).
    pub fwd_cnt: u32,
}

impl Header {
    /// Decodes the wire form.
    pub fn from_bytes(b: &[u8; HDR_LEN]) -> Self {
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let u32_at = |o: usize| {
            let mut a = [0u8; 4];
            a.copy_from_slice(&b[o..o + 4]);
            u32::from_le_bytes(a)
        };
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        Self {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            kind: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    /// Encodes the wire form.
    pub fn to_bytes(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.kind.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    /// A host-to-guest header of `op` for the connection `host_port` <-> `guest_port`.
    pub fn to_guest(guest_cid: u64, host_port: u32, guest_port: u32, op: u16) -> Self {
        Self {
            src_cid: VSOCK_HOST_CID,
            dst_cid: guest_cid,
            src_port: host_port,
            dst_port: guest_port,
            kind: TYPE_STREAM,
            op,
            ..Self::default()
        }
    }

    /// The reset answering `self` (a packet from the guest): addresses swapped, no credit.
    pub fn reset_reply(&self) -> Self {
        Self {
            src_cid: self.dst_cid,
            dst_cid: self.src_cid,
            src_port: self.dst_port,
            dst_port: self.src_port,
            kind: TYPE_STREAM,
            op: op::RST,
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_layout_is_packed_little_endian() {
        let h = Header {
            src_cid: 0x0102_0304_0506_0708,
            dst_cid: 2,
            src_port: 0xaabb_ccdd,
            dst_port: 1234,
            len: 5,
            kind: TYPE_STREAM,
            op: op::RW,
            flags: shutdown::SEND,
            buf_alloc: 0x4_0000,
            fwd_cnt: 0xffff_fffe,
        };
        let b = h.to_bytes();
        assert_eq!(&b[0..8], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&b[16..20], &[0xdd, 0xcc, 0xbb, 0xaa]);
        assert_eq!(&b[28..32], &[1, 0, 5, 0]);
        assert_eq!(&b[40..44], &[0xfe, 0xff, 0xff, 0xff]);
        assert_eq!(Header::from_bytes(&b), h);
    }

    #[test]
    fn reset_reply_swaps_addresses() {
        let h = Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 10,
            dst_port: 20,
            op: op::RW,
            len: 7,
            buf_alloc: 99,
            ..Header::default()
        };
        let r = h.reset_reply();
        assert_eq!(
            (r.src_cid, r.dst_cid, r.src_port, r.dst_port),
            (2, 3, 20, 10)
        );
        assert_eq!(
            (r.op, r.len, r.buf_alloc, r.kind),
            (op::RST, 0, 0, TYPE_STREAM)
        );
    }
}

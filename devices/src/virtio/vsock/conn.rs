//! One vsock stream connection between a guest socket and a host Unix socket: the state machine
//! of virtio 1.2 §5.10.6 and its credit-based flow control in both directions.
//!
//! Flow control, host → guest: the guest advertises `buf_alloc` and `fwd_cnt` in every packet;
//! the device never has more than `buf_alloc - (tx_cnt - fwd_cnt)` bytes in flight. It reads the
//! Unix socket only up to that credit (and at most [`STAGING_MAX`] ahead), so a guest that stops
//! reading makes the device stop reading that socket (no `EPOLLIN` interest) and nothing piles
//! up on the host.
//!
//! Flow control, guest → host: the device advertises [`CONN_BUF_ALLOC`] per connection. Guest
//! data is written straight to the Unix socket; what the socket does not take (`EAGAIN`) waits
//! in a per-connection buffer that the guest's own credit bounds to `CONN_BUF_ALLOC`, and
//! `fwd_cnt` advances only as bytes reach the socket. The shared tx queue is therefore never
//! held up by one slow host reader. A guest that sends beyond its credit violates the protocol:
//! the connection is reset instead of buffering more.
//!
//! Nothing here touches the virtqueues or epoll: the owner ([`super::muxer`]) feeds events in,
//! asks for the next packet for the guest and for the epoll interest, and acts on [`Verdict`]s.

use std::collections::VecDeque;
use std::io::{self, Read};
use std::net::Shutdown;
use std::num::Wrapping;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::EventSet;

use super::packet::{op, shutdown, Header};
use super::unix::send_nosignal;

/// Receive buffer the device advertises to the guest for each connection (`buf_alloc`): the
/// most guest data that can wait for a slow Unix peer.
pub const CONN_BUF_ALLOC: u32 = 256 * 1024;
/// Most host data read ahead of the guest, per connection.
pub const STAGING_MAX: usize = 64 * 1024;
/// A credit update is sent once the guest may believe it has less than this much room left.
pub const CREDIT_UPDATE_THRESHOLD: u32 = 64 * 1024;
/// How long a host-initiated request may wait for an rx buffer, and then, once delivered,
/// for the guest's answer. A guest kernel answers at once (RESPONSE, or RST when nothing
/// listens), so this only ends requests to a guest that has stopped; it is generous because a
/// guest on a loaded host (or on emulated ring 0) can go seconds without running.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a closing connection waits for the guest's RST.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(4);

/// A connection's address: the host port (ours) and the guest port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnKey {
    /// Port on the host side (`src_port` of our packets).
    pub local_port: u32,
    /// Port on the guest side.
    pub peer_port: u32,
}

/// What a snapshot keeps of an established connection (see [`Connection::preserved`]): its
/// address and the credit counters of both directions, so that the guest's socket goes on
/// as if nothing happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PreservedConn {
    /// Host port (ours).
    pub local_port: u32,
    /// Guest port.
    pub peer_port: u32,
    /// Bytes sent to the guest.
    pub tx_cnt: u32,
    /// The guest's receive buffer.
    pub peer_buf_alloc: u32,
    /// Bytes the guest has consumed.
    pub peer_fwd_cnt: u32,
    /// Bytes received from the guest.
    pub rx_cnt: u32,
    /// Bytes of those passed on to the host.
    pub fwd_cnt: u32,
}

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnState {
    /// Host-initiated: REQUEST queued or sent, waiting for RESPONSE or RST.
    Connecting,
    /// Data flows.
    Established,
    /// The host side is gone and SHUTDOWN(both) was sent: waiting for the guest's RST.
    Closing,
}

/// Why a connection was reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetCause {
    /// The guest broke the protocol (bad op for the state, data after shutdown, ...).
    Protocol,
    /// The guest sent more than its credit allowed.
    CreditViolation,
    /// The Unix socket failed.
    Unix,
    /// The host client went away before the guest answered.
    PeerGone,
    /// A deadline passed.
    Timeout,
}

/// What the owner must do after feeding the connection an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Keep going.
    Keep,
    /// Send RST to the guest and forget the connection (an orderly end: the guest asked for it).
    Close,
    /// Send RST to the guest and forget the connection (an error).
    Reset(ResetCause),
    /// Forget the connection without telling the guest (it reset it).
    Drop,
}

#[derive(Debug, Default)]
struct Pending {
    request: bool,
    response: bool,
    credit_update: bool,
}

/// One connection.
#[derive(Debug)]
pub struct Connection {
    key: ConnKey,
    state: ConnState,
    unix: Option<UnixStream>,
    /// Interest currently registered with epoll (owner-managed); `None`: not registered.
    pub registered: Option<EventSet>,
    /// Owner bookkeeping: queued in the rx round-robin.
    pub in_rx_queue: bool,
    /// Owner bookkeeping: interest needs re-syncing.
    pub dirty: bool,
    /// Opened by a host client (`CONNECT`), not by the guest.
    host_initiated: bool,
    /// Restored from a snapshot and not yet attached to a host client: guest data waits in
    /// `to_unix` (bounded by the credit the guest has) until [`Connection::attach`].
    detached: bool,
    /// The Unix peer hung up: nothing more can be written; what it sent is still read out.
    hup: bool,
    deadline: Option<Instant>,
    pending: Pending,

    // Host -> guest.
    staging: Vec<u8>,
    unix_eof: bool,
    tx_cnt: Wrapping<u32>,
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    credit_requested: bool,
    shutdown_sent: u32,

    // Guest -> host.
    unix_preamble: Vec<u8>,
    to_unix: VecDeque<u8>,
    rx_cnt: Wrapping<u32>,
    fwd_cnt: Wrapping<u32>,
    last_fwd_cnt_sent: Wrapping<u32>,
    peer_shutdown: u32,
    unix_wr_shut: bool,
}

impl Connection {
    fn new(key: ConnKey, state: ConnState, unix: UnixStream) -> Self {
        Self {
            unix: Some(unix),
            state,
            ..Self::new_without_socket(key)
        }
    }

    fn new_without_socket(key: ConnKey) -> Self {
        Self {
            key,
            state: ConnState::Established,
            unix: None,
            registered: None,
            in_rx_queue: false,
            dirty: false,
            host_initiated: false,
            detached: false,
            hup: false,
            deadline: None,
            pending: Pending::default(),
            staging: Vec::new(),
            unix_eof: false,
            tx_cnt: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            credit_requested: false,
            shutdown_sent: 0,
            unix_preamble: Vec::new(),
            to_unix: VecDeque::new(),
            rx_cnt: Wrapping(0),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            peer_shutdown: 0,
            unix_wr_shut: false,
        }
    }

    /// A host client asked (`CONNECT <port>`) for a connection to guest port `key.peer_port`;
    /// `early` holds bytes it sent after its request line.
    pub fn host_initiated(key: ConnKey, unix: UnixStream, early: Vec<u8>, now: Instant) -> Self {
        let mut c = Self::new(key, ConnState::Connecting, unix);
        c.host_initiated = true;
        c.pending.request = true;
        c.staging = early;
        c.deadline = Some(now + CONNECT_TIMEOUT);
        c
    }

    /// The guest's REQUEST `req` was connected to a host socket.
    pub fn guest_initiated(key: ConnKey, unix: UnixStream, req: &Header) -> Self {
        let mut c = Self::new(key, ConnState::Established, unix);
        c.pending.response = true;
        c.peer_buf_alloc = req.buf_alloc;
        c.peer_fwd_cnt = Wrapping(req.fwd_cnt);
        c
    }

    /// What a snapshot keeps of this connection, if it can be kept: an established,
    /// host-initiated connection with nothing buffered in either direction and no shutdown
    /// under way. Anything else is reset when the snapshot is restored.
    pub fn preserved(&self) -> Option<PreservedConn> {
        let quiet = self.state == ConnState::Established
            && self.host_initiated
            && !self.hup
            && !self.unix_eof
            && !self.pending.response
            && self.staging.is_empty()
            && self.to_unix.is_empty()
            && self.unix_preamble.is_empty()
            && self.peer_shutdown == 0
            && self.shutdown_sent == 0;
        quiet.then_some(PreservedConn {
            local_port: self.key.local_port,
            peer_port: self.key.peer_port,
            tx_cnt: self.tx_cnt.0,
            peer_buf_alloc: self.peer_buf_alloc,
            peer_fwd_cnt: self.peer_fwd_cnt.0,
            rx_cnt: self.rx_cnt.0,
            fwd_cnt: self.fwd_cnt.0,
        })
    }

    /// A connection restored from a snapshot, waiting for a host client to attach.
    pub fn detached(p: &PreservedConn) -> Self {
        let key = ConnKey {
            local_port: p.local_port,
            peer_port: p.peer_port,
        };
        let mut c = Self::new_without_socket(key);
        c.host_initiated = true;
        c.detached = true;
        c.tx_cnt = Wrapping(p.tx_cnt);
        c.peer_buf_alloc = p.peer_buf_alloc;
        c.peer_fwd_cnt = Wrapping(p.peer_fwd_cnt);
        c.rx_cnt = Wrapping(p.rx_cnt);
        c.fwd_cnt = Wrapping(p.fwd_cnt);
        c.last_fwd_cnt_sent = Wrapping(p.fwd_cnt);
        c
    }

    /// Whether it waits for a host client ([`Connection::detached`]).
    pub fn is_detached(&self) -> bool {
        self.detached
    }

    /// Gives a detached connection its host client: `OK <host port>\n` goes out first, then
    /// what the guest sent meanwhile; `early` (bytes the client sent after its `ATTACH` line)
    /// goes to the guest.
    pub fn attach(&mut self, unix: UnixStream, early: Vec<u8>) -> Verdict {
        self.unix = Some(unix);
        self.detached = false;
        self.unix_preamble = format!("OK {}\n", self.key.local_port).into_bytes();
        self.staging.extend_from_slice(&early);
        self.pump()
    }

    /// Its state.
    #[cfg(test)]
    pub fn state(&self) -> ConnState {
        self.state
    }

    /// The Unix socket's descriptor, while the connection holds one.
    pub fn unix_fd(&self) -> Option<RawFd> {
        self.unix.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Whether a deadline is set (the owner runs a timer while any is).
    pub fn has_deadline(&self) -> bool {
        self.deadline.is_some()
    }

    /// The Unix socket once the connection no longer needs it (the owner closes it).
    pub fn take_finished_unix(&mut self) -> Option<UnixStream> {
        if self.state == ConnState::Closing {
            self.unix.take()
        } else {
            None
        }
    }

    /// The Unix socket, for closing it (the connection is being dropped).
    pub fn take_unix(&mut self) -> Option<UnixStream> {
        self.unix.take()
    }

    /// The RST that ends this connection on the guest's side.
    pub fn rst_header(&self, guest_cid: u64) -> Header {
        Header::to_guest(guest_cid, self.key.local_port, self.key.peer_port, op::RST)
    }

    /// Bytes the guest can still take.
    fn peer_credit(&self) -> u32 {
        let in_flight = (self.tx_cnt - self.peer_fwd_cnt).0;
        // A `fwd_cnt` ahead of what was sent makes `in_flight` huge: no credit, never more.
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    fn peer_rcv_open(&self) -> bool {
        self.peer_shutdown & shutdown::RCV == 0
    }

    /// Whether reading the Unix socket now could produce something for the guest.
    fn wants_read(&self) -> bool {
        self.unix.is_some()
            && self.state == ConnState::Established
            && !self.unix_eof
            && self.peer_rcv_open()
            && self.staging.len() < (self.peer_credit() as usize).min(STAGING_MAX)
    }

    /// The epoll interest the Unix socket should have; `None`: it should not be registered.
    pub fn interest(&self) -> Option<EventSet> {
        self.unix.as_ref()?;
        if self.hup {
            return None;
        }
        let mut s = EventSet::empty();
        if self.wants_read() {
            s |= EventSet::IN;
        }
        if !self.unix_preamble.is_empty() || !self.to_unix.is_empty() {
            s |= EventSet::OUT;
        }
        Some(s)
    }

    /// Shutdown flags the host side has earned: SEND once the Unix peer can send nothing more
    /// for the guest, RCV once it can take nothing more.
    fn local_shutdown(&self) -> u32 {
        let mut f = 0;
        if self.unix_eof || (self.hup && !self.peer_rcv_open()) {
            f |= shutdown::SEND;
        }
        if self.hup {
            f |= shutdown::RCV;
        }
        f
    }

    fn shutdown_due(&self) -> bool {
        let new = self.local_shutdown() & !self.shutdown_sent;
        // SEND only goes out after the last data.
        new != 0 && (new & shutdown::SEND == 0 || self.staging.is_empty() || !self.peer_rcv_open())
    }

    fn data_ready(&self) -> bool {
        !self.staging.is_empty() && self.peer_credit() > 0 && self.peer_rcv_open()
    }

    fn wants_credit_request(&self) -> bool {
        !self.credit_requested
            && self.peer_credit() == 0
            && self.peer_rcv_open()
            && (!self.staging.is_empty() || (!self.unix_eof && self.unix.is_some()))
    }

    /// Whether a packet is waiting for an rx buffer.
    pub fn has_rx_work(&self) -> bool {
        match self.state {
            ConnState::Connecting => self.pending.request,
            ConnState::Closing => false,
            ConnState::Established => {
                self.pending.response
                    || self.data_ready()
                    || self.shutdown_due()
                    || self.pending.credit_update
                    || self.wants_credit_request()
            }
        }
    }

    /// The next packet for the guest, with at most `max_payload` bytes of data copied into
    /// `payload` (which is cleared first). The connection's counters advance as if the packet
    /// was delivered.
    pub fn next_packet(
        &mut self,
        guest_cid: u64,
        max_payload: usize,
        payload: &mut Vec<u8>,
        now: Instant,
    ) -> Option<Header> {
        payload.clear();
        let mut h = Header::to_guest(guest_cid, self.key.local_port, self.key.peer_port, 0);
        match self.state {
            ConnState::Connecting if self.pending.request => {
                self.pending.request = false;
                // The guest's clock starts when it has the request.
                self.deadline = Some(now + CONNECT_TIMEOUT);
                h.op = op::REQUEST;
            }
            ConnState::Established => {
                if self.pending.response {
                    self.pending.response = false;
                    h.op = op::RESPONSE;
                } else if self.data_ready() && max_payload > 0 {
                    let n = self
                        .staging
                        .len()
                        .min(self.peer_credit() as usize)
                        .min(max_payload);
                    payload.extend(self.staging.drain(..n));
                    // n <= peer credit, a u32.
                    let n32 = u32::try_from(n).unwrap_or(u32::MAX);
                    self.tx_cnt += n32;
                    h.op = op::RW;
                    h.len = n32;
                } else if self.shutdown_due() {
                    let flags = self.local_shutdown();
                    self.shutdown_sent = flags;
                    h.op = op::SHUTDOWN;
                    h.flags = flags;
                    if flags == shutdown::BOTH {
                        self.state = ConnState::Closing;
                        self.deadline = Some(now + CLOSE_TIMEOUT);
                        self.staging = Vec::new();
                        self.to_unix = VecDeque::new();
                    }
                } else if self.pending.credit_update {
                    h.op = op::CREDIT_UPDATE;
                } else if self.wants_credit_request() {
                    self.credit_requested = true;
                    h.op = op::CREDIT_REQUEST;
                } else {
                    return None;
                }
            }
            _ => return None,
        }
        // Every packet carries our credit.
        h.buf_alloc = CONN_BUF_ALLOC;
        h.fwd_cnt = self.fwd_cnt.0;
        self.last_fwd_cnt_sent = self.fwd_cnt;
        self.pending.credit_update = false;
        Some(h)
    }

    /// A packet from the guest for this connection (addresses already checked; `payload` is
    /// exactly `hdr.len` bytes).
    pub fn on_guest_packet(&mut self, hdr: &Header, payload: &[u8]) -> Verdict {
        if hdr.op == op::RST {
            return Verdict::Drop;
        }
        // The guest's receive-buffer state travels in every header.
        self.peer_buf_alloc = hdr.buf_alloc;
        self.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        if self.peer_credit() > 0 {
            self.credit_requested = false;
        }
        let v = match (hdr.op, self.state) {
            (op::RESPONSE, ConnState::Connecting) => {
                self.state = ConnState::Established;
                self.deadline = None;
                self.unix_preamble = format!("OK {}\n", self.key.local_port).into_bytes();
                Verdict::Keep
            }
            (op::RW, ConnState::Established) if self.peer_shutdown & shutdown::SEND == 0 => {
                self.accept_data(payload)
            }
            // Late data racing our SHUTDOWN: nobody is left to read it.
            (op::RW, ConnState::Closing) => Verdict::Keep,
            (op::CREDIT_UPDATE, ConnState::Established | ConnState::Closing) => Verdict::Keep,
            (op::CREDIT_REQUEST, ConnState::Established) => {
                self.pending.credit_update = true;
                Verdict::Keep
            }
            (op::CREDIT_REQUEST, ConnState::Closing) => Verdict::Keep,
            (op::SHUTDOWN, ConnState::Established) => {
                self.peer_shutdown |= hdr.flags & shutdown::BOTH;
                if !self.peer_rcv_open() && !self.staging.is_empty() {
                    self.staging = Vec::new();
                }
                if !self.peer_rcv_open() {
                    if let Some(u) = &self.unix {
                        let _ = u.shutdown(Shutdown::Read);
                    }
                }
                Verdict::Keep
            }
            // Our SHUTDOWN(both) crossed theirs: end it.
            (op::SHUTDOWN, ConnState::Closing) => Verdict::Close,
            _ => Verdict::Reset(ResetCause::Protocol),
        };
        if v != Verdict::Keep {
            return v;
        }
        self.pump()
    }

    fn accept_data(&mut self, payload: &[u8]) -> Verdict {
        let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        let buffered = (self.rx_cnt - self.fwd_cnt).0;
        if u64::from(buffered) + u64::from(len) > u64::from(CONN_BUF_ALLOC) {
            return Verdict::Reset(ResetCause::CreditViolation);
        }
        self.rx_cnt += len;
        let mut rest = payload;
        if self.hup || (self.unix.is_none() && !self.detached) {
            // Nobody can read it any more: consume it so the guest is not left without credit.
            self.fwd_cnt += len;
            rest = &[];
        } else if self.to_unix.is_empty() && self.unix_preamble.is_empty() {
            if let Some(u) = &self.unix {
                match write_some(u, payload) {
                    Ok(n) => {
                        self.fwd_cnt += u32::try_from(n).unwrap_or(0);
                        rest = &payload[n..];
                    }
                    Err(_) => return Verdict::Reset(ResetCause::Unix),
                }
            }
        }
        self.to_unix.extend(rest);
        self.maybe_credit_update();
        Verdict::Keep
    }

    fn maybe_credit_update(&mut self) {
        if self.fwd_cnt == self.last_fwd_cnt_sent {
            return;
        }
        let believed_used = (self.rx_cnt - self.last_fwd_cnt_sent).0;
        if CONN_BUF_ALLOC.saturating_sub(believed_used) < CREDIT_UPDATE_THRESHOLD {
            self.pending.credit_update = true;
        }
    }

    /// Writes what waits for the Unix socket.
    fn flush_unix(&mut self) -> Verdict {
        if self.hup {
            return Verdict::Keep;
        }
        let Some(u) = &self.unix else {
            return Verdict::Keep;
        };
        while !self.unix_preamble.is_empty() {
            match write_some(u, &self.unix_preamble) {
                Ok(0) => return Verdict::Keep,
                Ok(n) => {
                    self.unix_preamble.drain(..n);
                }
                Err(_) => return Verdict::Reset(ResetCause::Unix),
            }
        }
        while !self.to_unix.is_empty() {
            let (front, _) = self.to_unix.as_slices();
            match write_some(u, front) {
                Ok(0) => break,
                Ok(n) => {
                    self.to_unix.drain(..n);
                    self.fwd_cnt += u32::try_from(n).unwrap_or(0);
                }
                Err(_) => return Verdict::Reset(ResetCause::Unix),
            }
        }
        self.maybe_credit_update();
        Verdict::Keep
    }

    /// Reads the Unix socket as far as the guest's credit and the staging bound allow.
    fn fill_staging(&mut self) -> Verdict {
        while self.wants_read() {
            let limit = (self.peer_credit() as usize).min(STAGING_MAX);
            let Some(u) = self.unix.as_mut() else {
                break;
            };
            let old = self.staging.len();
            self.staging.resize(limit, 0);
            match u.read(&mut self.staging[old..]) {
                Ok(0) => {
                    self.staging.truncate(old);
                    self.unix_eof = true;
                }
                Ok(n) => self.staging.truncate(old + n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => self.staging.truncate(old),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.staging.truncate(old);
                    break;
                }
                Err(_) => {
                    self.staging.truncate(old);
                    return Verdict::Reset(ResetCause::Unix);
                }
            }
        }
        Verdict::Keep
    }

    /// Applies the consequences of the guest's shutdown flags once buffered data is out. A
    /// guest that closed while its last data waits for a slow Unix reader keeps the connection
    /// (and its bounded buffer) until the reader takes the data or hangs up: nothing is lost.
    fn settle_peer_shutdown(&mut self) -> Verdict {
        if self.peer_shutdown & shutdown::SEND == 0 {
            return Verdict::Keep;
        }
        let flushed = self.to_unix.is_empty() && self.unix_preamble.is_empty();
        if flushed && !self.unix_wr_shut {
            if let Some(u) = &self.unix {
                let _ = u.shutdown(Shutdown::Write);
            }
            self.unix_wr_shut = true;
        }
        let done = flushed || self.hup || (self.unix.is_none() && !self.detached);
        if self.peer_shutdown == shutdown::BOTH && self.state == ConnState::Established && done {
            return Verdict::Close;
        }
        Verdict::Keep
    }

    /// Moves data both ways as far as it can go without blocking.
    pub fn pump(&mut self) -> Verdict {
        for step in [Self::flush_unix, Self::fill_staging] {
            let v = step(self);
            if v != Verdict::Keep {
                return v;
            }
        }
        self.settle_peer_shutdown()
    }

    /// The Unix socket is ready (`set` as reported by epoll).
    pub fn on_unix_event(&mut self, set: EventSet) -> Verdict {
        if set.intersects(EventSet::HANG_UP | EventSet::ERROR) && !self.hup {
            if self.state == ConnState::Connecting {
                return Verdict::Reset(ResetCause::PeerGone);
            }
            self.hup = true;
            // What the peer will never read still counts as consumed for the guest's credit.
            let dropped = u32::try_from(self.to_unix.len()).unwrap_or(0);
            self.fwd_cnt += dropped;
            self.to_unix = VecDeque::new();
            self.unix_preamble = Vec::new();
            self.maybe_credit_update();
        }
        self.pump()
    }

    /// Deadline handling.
    pub fn on_tick(&mut self, now: Instant) -> Verdict {
        match self.deadline {
            Some(d) if d <= now => match self.state {
                ConnState::Closing => Verdict::Close,
                _ => Verdict::Reset(ResetCause::Timeout),
            },
            _ => Verdict::Keep,
        }
    }
}

/// Writes what the socket takes now: `Ok(0)` when it takes nothing (`EAGAIN`).
fn write_some(u: &UnixStream, buf: &[u8]) -> io::Result<usize> {
    loop {
        match send_nosignal(u, buf) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const CID: u64 = 3;

    fn pair() -> (UnixStream, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        (a, b)
    }

    fn guest_hdr(op: u16, buf_alloc: u32, fwd_cnt: u32) -> Header {
        Header {
            src_cid: CID,
            dst_cid: 2,
            src_port: 1000,
            dst_port: 5000,
            kind: 1,
            op,
            buf_alloc,
            fwd_cnt,
            ..Header::default()
        }
    }

    fn established(buf_alloc: u32) -> (Connection, UnixStream) {
        let (dev_side, host) = pair();
        let key = ConnKey {
            local_port: 5000,
            peer_port: 1000,
        };
        let mut c =
            Connection::guest_initiated(key, dev_side, &guest_hdr(op::REQUEST, buf_alloc, 0));
        let mut p = Vec::new();
        let h = c.next_packet(CID, 4096, &mut p, Instant::now()).unwrap();
        assert_eq!(h.op, op::RESPONSE);
        (c, host)
    }

    #[test]
    fn credit_arithmetic_wraps_and_never_exceeds_buf_alloc() {
        let (mut c, _h) = established(100);
        c.tx_cnt = Wrapping(u32::MAX - 9);
        c.peer_fwd_cnt = Wrapping(u32::MAX - 9);
        assert_eq!(c.peer_credit(), 100);
        c.tx_cnt += 60; // wraps past zero
        assert_eq!(c.peer_credit(), 40);
        // A hostile fwd_cnt ahead of tx_cnt gives no credit at all.
        c.peer_fwd_cnt = c.tx_cnt + Wrapping(5);
        assert_eq!(c.peer_credit(), 0);
    }

    #[test]
    fn host_data_respects_guest_credit() {
        let (mut c, mut host) = established(10);
        host.write_all(&[7u8; 100]).unwrap();
        let now = Instant::now();
        assert_eq!(c.on_unix_event(EventSet::IN), Verdict::Keep);
        // Only the credit was read from the socket; no more read interest.
        assert_eq!(c.staging.len(), 10);
        assert_eq!(c.interest(), Some(EventSet::empty()));
        let mut p = Vec::new();
        let h = c.next_packet(CID, 4096, &mut p, now).unwrap();
        assert_eq!((h.op, h.len, p.len()), (op::RW, 10, 10));
        // Out of credit: one credit request, then nothing.
        let h = c.next_packet(CID, 4096, &mut p, now).unwrap();
        assert_eq!(h.op, op::CREDIT_REQUEST);
        assert!(c.next_packet(CID, 4096, &mut p, now).is_none());
        assert!(!c.has_rx_work());
        // The guest consumed 10: reading resumes.
        let upd = guest_hdr(op::CREDIT_UPDATE, 10, 10);
        assert_eq!(c.on_guest_packet(&upd, &[]), Verdict::Keep);
        assert_eq!(c.staging.len(), 10);
    }

    #[test]
    fn guest_data_beyond_credit_resets() {
        let (mut c, _host) = established(1000);
        // The host never reads: the socket buffer fills, then our buffer, then the guest
        // overruns its credit.
        let chunk = vec![1u8; 64 * 1024];
        let mut sent = 0u64;
        let v = loop {
            let v = c.on_guest_packet(&guest_hdr(op::RW, 1000, 0), &chunk);
            if v != Verdict::Keep {
                break v;
            }
            sent += chunk.len() as u64;
            assert!(sent < 64 << 20, "never reset");
        };
        assert_eq!(v, Verdict::Reset(ResetCause::CreditViolation));
        assert!(c.to_unix.len() <= CONN_BUF_ALLOC as usize);
    }

    #[test]
    fn credit_update_after_draining() {
        let (mut c, mut host) = established(1000);
        let now = Instant::now();
        let chunk = vec![1u8; 64 * 1024];
        // Fill until the buffer holds data (the socket is full).
        while c.to_unix.is_empty() {
            assert_eq!(
                c.on_guest_packet(&guest_hdr(op::RW, 1000, 0), &chunk),
                Verdict::Keep
            );
        }
        // Keep sending within credit until the guest believes it is nearly out.
        while (c.rx_cnt - c.fwd_cnt).0 + 64 * 1024 <= CONN_BUF_ALLOC {
            assert_eq!(
                c.on_guest_packet(&guest_hdr(op::RW, 1000, 0), &chunk),
                Verdict::Keep
            );
        }
        let mut sink = vec![0u8; 1 << 20];
        let mut total = 0;
        while let Ok(n) = host.read(&mut sink) {
            total += n;
        }
        assert!(total > 0);
        assert_eq!(c.on_unix_event(EventSet::OUT), Verdict::Keep);
        assert!(c.has_rx_work());
        let mut p = Vec::new();
        let h = c.next_packet(CID, 4096, &mut p, now).unwrap();
        assert_eq!(h.op, op::CREDIT_UPDATE);
        assert_eq!(h.fwd_cnt, c.fwd_cnt.0);
        assert_eq!(h.buf_alloc, CONN_BUF_ALLOC);
    }

    #[test]
    fn peer_shutdown_both_closes_after_flush() {
        let (mut c, mut host) = established(1000);
        assert_eq!(
            c.on_guest_packet(&guest_hdr(op::RW, 1000, 0), b"bye"),
            Verdict::Keep
        );
        let mut sd = guest_hdr(op::SHUTDOWN, 1000, 0);
        sd.flags = shutdown::BOTH;
        assert_eq!(c.on_guest_packet(&sd, &[]), Verdict::Close);
        let mut b = [0u8; 3];
        host.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"bye");
    }

    #[test]
    fn host_hangup_sends_data_then_shutdown_both() {
        let (mut c, mut host) = established(1000);
        host.write_all(b"last words").unwrap();
        drop(host);
        let now = Instant::now();
        assert_eq!(
            c.on_unix_event(EventSet::IN | EventSet::HANG_UP),
            Verdict::Keep
        );
        assert_eq!(c.interest(), None);
        let mut p = Vec::new();
        let h = c.next_packet(CID, 4096, &mut p, now).unwrap();
        assert_eq!((h.op, &p[..]), (op::RW, &b"last words"[..]));
        let h = c.next_packet(CID, 4096, &mut p, now).unwrap();
        assert_eq!((h.op, h.flags), (op::SHUTDOWN, shutdown::BOTH));
        assert_eq!(c.state(), ConnState::Closing);
        assert!(c.take_finished_unix().is_some());
        assert_eq!(
            c.on_guest_packet(&guest_hdr(op::RST, 0, 0), &[]),
            Verdict::Drop
        );
        assert_eq!(c.on_tick(now + CLOSE_TIMEOUT), Verdict::Close);
    }

    #[test]
    fn wrong_ops_for_the_state_reset() {
        let (mut c, _h) = established(1000);
        for opc in [op::REQUEST, op::RESPONSE, 0, 8, 0xffff] {
            assert_eq!(
                c.on_guest_packet(&guest_hdr(opc, 1000, 0), &[]),
                Verdict::Reset(ResetCause::Protocol),
                "op {opc}"
            );
        }
    }
}

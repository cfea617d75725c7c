//! The host side of the device: the listening Unix socket, host clients completing their
//! `CONNECT` line, the connection table, and the order in which connections get rx buffers.
//!
//! Sockets are registered with the event loop lazily: state changes only mark a connection
//! dirty, and [`Muxer::sync`] (run at the end of every `process` call, when `EventOps` is at hand)
//! brings epoll in line. A socket still registered with epoll is never closed directly: it goes
//! to `zombies` and is unregistered first, because event-manager keeps a map from descriptor
//! number to subscriber and a reused number would otherwise be refused (or misrouted).

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use event_manager::{EventOps, Events};
use vmm_sys_util::epoll::EventSet;

use super::conn::{ConnKey, Connection, PreservedConn, ResetCause, Verdict};
use super::packet::{op, Header, TYPE_STREAM};
use super::unix::{self, ConnectLine, Listener, MAX_CONNECT_LINE};
use super::VsockMetrics;

/// Most connections per device; further requests (either side) are refused.
pub const MAX_CONNECTIONS: usize = 512;
/// Most host clients that have connected but not yet sent their `CONNECT` line.
pub const MAX_HANDSHAKES: usize = 64;
/// How long a host client has to send its `CONNECT` line.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Most control replies (RSTs to packets without a connection) waiting for rx buffers.
pub const MAX_CTL_REPLIES: usize = 1024;
/// First host port handed out to host-initiated connections.
pub const LOCAL_PORT_START: u32 = 1 << 30;
/// Connections accepted per listener event (fairness with the rest of the event loop).
const ACCEPT_BURST: usize = 32;

#[derive(Debug)]
struct Handshake {
    stream: UnixStream,
    buf: Vec<u8>,
    registered: bool,
    deadline: Instant,
}

/// The connections a snapshot keeps (part of the device's snapshot state).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VsockConnections {
    /// Established, quiet, host-initiated connections: restored detached, for `ATTACH`.
    pub preserved: Vec<PreservedConn>,
    /// `(host port, guest port)` of every other connection: reset at restore.
    pub reset: Vec<(u32, u32)>,
}

/// What the device should do with a descriptor it got an event for.
#[derive(Debug, PartialEq, Eq)]
pub enum FdKind {
    /// Handled.
    Known,
    /// Not ours (any more): unregister it.
    Unknown,
}

/// The host side of the device.
#[derive(Debug)]
pub struct Muxer {
    pub guest_cid: u64,
    uds_path: PathBuf,
    listener: Option<Listener>,
    /// Interest registered for the listener; `None`: not registered.
    listener_registered: Option<EventSet>,
    /// accept(2) failed for want of resources: stop watching the listener until the next tick
    /// (a level-triggered listener would otherwise wake the loop in a tight circle).
    listener_paused: bool,
    handshakes: HashMap<RawFd, Handshake>,
    conns: HashMap<ConnKey, Connection>,
    by_fd: HashMap<RawFd, ConnKey>,
    rx_ready: VecDeque<ConnKey>,
    ctl: VecDeque<Header>,
    dirty: Vec<ConnKey>,
    zombies: Vec<OwnedFd>,
    next_port: u32,
    /// A deadline was set since the timer was last looked at.
    pub timer_wanted: bool,
    pub metrics: VsockMetrics,
}

impl Muxer {
    /// Listens on `uds_path`.
    pub fn new(guest_cid: u64, uds_path: PathBuf) -> io::Result<Self> {
        let listener = Listener::bind(&uds_path)?;
        Ok(Self {
            guest_cid,
            uds_path,
            listener: Some(listener),
            listener_registered: None,
            listener_paused: false,
            handshakes: HashMap::new(),
            conns: HashMap::new(),
            by_fd: HashMap::new(),
            rx_ready: VecDeque::new(),
            ctl: VecDeque::new(),
            dirty: Vec::new(),
            zombies: Vec::new(),
            next_port: LOCAL_PORT_START,
            timer_wanted: false,
            metrics: VsockMetrics::default(),
        })
    }

    /// Number of live connections.
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// The listening socket's descriptor.
    pub fn listener_fd(&self) -> Option<RawFd> {
        self.listener.as_ref().map(|l| l.sock.as_raw_fd())
    }

    /// Listens on `path` instead; connections already open stay.
    pub fn retarget(&mut self, path: PathBuf) -> io::Result<()> {
        let new = Listener::bind(&path)?;
        if let Some(old) = self.listener.replace(new) {
            old.unlink();
            if self.listener_registered.is_some() {
                self.zombies.push(OwnedFd::from(old.sock));
            }
        }
        self.listener_registered = None;
        self.uds_path = path;
        Ok(())
    }

    /// Removes the socket file (device going away).
    pub fn unlink_listener(&self) {
        if let Some(l) = &self.listener {
            l.unlink();
        }
    }

    fn dispose(&mut self, s: UnixStream, registered: bool) {
        let _ = s.shutdown(Shutdown::Both);
        if registered {
            self.zombies.push(OwnedFd::from(s));
        }
    }

    /// Drops every connection (guest reset or transport reset); host peers see EOF at once.
    pub fn drop_all(&mut self) {
        let conns: Vec<Connection> = self.conns.drain().map(|(_, c)| c).collect();
        for mut c in conns {
            let registered = c.registered.is_some();
            if let Some(s) = c.take_unix() {
                self.dispose(s, registered);
            }
            self.metrics.conns_closed += 1;
        }
        self.by_fd.clear();
        self.rx_ready.clear();
        self.ctl.clear();
        self.dirty.clear();
    }

    fn retire(&mut self, key: ConnKey) {
        if let Some(mut c) = self.conns.remove(&key) {
            if let Some(fd) = c.unix_fd() {
                self.by_fd.remove(&fd);
            }
            let registered = c.registered.is_some();
            if let Some(s) = c.take_unix() {
                self.dispose(s, registered);
            }
            self.metrics.conns_closed += 1;
        }
    }

    fn queue_ctl(&mut self, h: Header) {
        if self.ctl.len() >= MAX_CTL_REPLIES {
            self.metrics.replies_dropped += 1;
            return;
        }
        if h.op == op::RST {
            self.metrics.resets_sent += 1;
        }
        self.ctl.push_back(h);
    }

    /// Acts on what a connection asked for after an event.
    fn settle(&mut self, key: ConnKey, v: Verdict) {
        match v {
            Verdict::Keep => {
                let Some(c) = self.conns.get_mut(&key) else {
                    return;
                };
                let registered = c.registered.is_some();
                let fd = c.unix_fd();
                let finished = c.take_finished_unix();
                if c.has_deadline() {
                    self.timer_wanted = true;
                }
                if !c.dirty {
                    c.dirty = true;
                    self.dirty.push(key);
                }
                let rx = c.has_rx_work() && !c.in_rx_queue;
                if rx {
                    c.in_rx_queue = true;
                    self.rx_ready.push_back(key);
                }
                if let Some(s) = finished {
                    if let Some(c) = self.conns.get_mut(&key) {
                        c.registered = None;
                    }
                    if let Some(fd) = fd {
                        self.by_fd.remove(&fd);
                    }
                    self.dispose(s, registered);
                }
            }
            Verdict::Close | Verdict::Reset(_) => {
                if let Verdict::Reset(cause) = v {
                    crate::debug_limited!("vsock: resetting connection {key:?}: {cause:?}");
                    if cause == ResetCause::CreditViolation {
                        self.metrics.credit_violations += 1;
                    }
                }
                if let Some(c) = self.conns.get(&key) {
                    let rst = c.rst_header(self.guest_cid);
                    self.queue_ctl(rst);
                }
                self.retire(key);
            }
            Verdict::Drop => self.retire(key),
        }
    }

    /// A well-addressed packet from the guest (`payload` is exactly `hdr.len` bytes).
    pub fn on_guest_packet(&mut self, hdr: &Header, payload: &[u8]) {
        let key = ConnKey {
            local_port: hdr.dst_port,
            peer_port: hdr.src_port,
        };
        if self.conns.contains_key(&key) {
            let v = if hdr.op == op::RST {
                // Never answer a reset with a reset.
                Verdict::Drop
            } else if hdr.kind != TYPE_STREAM || hdr.op == op::REQUEST {
                // Another request on a live connection, or a foreign socket type.
                Verdict::Reset(ResetCause::Protocol)
            } else {
                match self.conns.get_mut(&key) {
                    Some(c) => c.on_guest_packet(hdr, payload),
                    None => return,
                }
            };
            self.settle(key, v);
            return;
        }
        match hdr.op {
            op::RST => {}
            op::REQUEST if hdr.kind == TYPE_STREAM => self.guest_connect(key, hdr),
            _ => self.queue_ctl(hdr.reset_reply()),
        }
    }

    /// A packet whose payload could not be read (length beyond the chain or the maximum).
    pub fn on_guest_bad_payload(&mut self, hdr: &Header) {
        let key = ConnKey {
            local_port: hdr.dst_port,
            peer_port: hdr.src_port,
        };
        if self.conns.contains_key(&key) {
            self.settle(key, Verdict::Reset(ResetCause::Protocol));
        } else if hdr.op != op::RST {
            self.queue_ctl(hdr.reset_reply());
        }
    }

    fn guest_connect(&mut self, key: ConnKey, req: &Header) {
        if self.conns.len() >= MAX_CONNECTIONS {
            crate::warn_limited!(
                "vsock: connection limit reached; refusing guest port {}",
                req.src_port
            );
            self.metrics.connect_failures += 1;
            self.queue_ctl(req.reset_reply());
            return;
        }
        let path = unix::port_path(&self.uds_path, key.local_port);
        match unix::connect_nonblocking(&path) {
            Ok(s) => {
                let fd = s.as_raw_fd();
                let c = Connection::guest_initiated(key, s, req);
                self.conns.insert(key, c);
                self.by_fd.insert(fd, key);
                self.metrics.conns_opened += 1;
                self.settle(key, Verdict::Keep);
            }
            Err(e) => {
                crate::debug_limited!("vsock: guest connect to {}: {e}", path.display());
                self.metrics.connect_failures += 1;
                self.queue_ctl(req.reset_reply());
            }
        }
    }

    /// Accepts waiting host clients.
    pub fn accept(&mut self, active: bool, now: Instant) {
        for _ in 0..ACCEPT_BURST {
            let Some(l) = &self.listener else {
                return;
            };
            let stream = match l.sock.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) =>
                {
                    continue
                }
                Err(e) => {
                    // EMFILE, ENOBUFS, ...: out of resources. Pause until the next tick.
                    crate::warn_limited!("vsock: accept on {}: {e}", self.uds_path.display());
                    self.listener_paused = true;
                    self.timer_wanted = true;
                    return;
                }
            };
            if self.handshakes.len() >= MAX_HANDSHAKES || stream.set_nonblocking(true).is_err() {
                continue;
            }
            let fd = stream.as_raw_fd();
            self.handshakes.insert(
                fd,
                Handshake {
                    stream,
                    buf: Vec::new(),
                    registered: false,
                    deadline: now + HANDSHAKE_TIMEOUT,
                },
            );
            self.timer_wanted = true;
            // The line is often there already.
            self.on_handshake(fd, EventSet::IN, active, now);
        }
    }

    fn close_handshake(&mut self, fd: RawFd) {
        if let Some(h) = self.handshakes.remove(&fd) {
            self.dispose(h.stream, h.registered);
        }
    }

    fn on_handshake(&mut self, fd: RawFd, set: EventSet, active: bool, now: Instant) {
        let Some(h) = self.handshakes.get_mut(&fd) else {
            return;
        };
        let mut eof = set.intersects(EventSet::HANG_UP | EventSet::ERROR);
        let mut chunk = [0u8; MAX_CONNECT_LINE];
        let room = MAX_CONNECT_LINE.saturating_sub(h.buf.len());
        if room > 0 {
            match h.stream.read(&mut chunk[..room]) {
                Ok(0) => eof = true,
                Ok(n) => h.buf.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                Err(_) => eof = true,
            }
        }
        let line = unix::parse_connect_line(&h.buf);
        if let ConnectLine::Attach {
            port,
            host_port,
            consumed,
        } = line
        {
            if !eof && self.attach(fd, port, host_port, consumed) {
                return;
            }
        }
        if let ConnectLine::Connect { port, .. } = line {
            if !eof {
                self.drop_detached(port);
            }
        }
        match line {
            ConnectLine::Incomplete if !eof => {}
            ConnectLine::Connect { port, consumed }
            | ConnectLine::Attach { port, consumed, .. }
                if !eof =>
            {
                if !active || self.conns.len() >= MAX_CONNECTIONS {
                    crate::debug_limited!(
                        "vsock: host CONNECT {port} refused (device inactive or full)"
                    );
                    self.close_handshake(fd);
                    return;
                }
                let Some(h) = self.handshakes.remove(&fd) else {
                    return;
                };
                let early = h.buf.get(consumed..).unwrap_or_default().to_vec();
                let local_port = self.allocate_port(port);
                let key = ConnKey {
                    local_port,
                    peer_port: port,
                };
                let mut c = Connection::host_initiated(key, h.stream, early, now);
                c.registered = h.registered.then_some(EventSet::IN);
                self.conns.insert(key, c);
                self.by_fd.insert(fd, key);
                self.metrics.conns_opened += 1;
                self.settle(key, Verdict::Keep);
            }
            _ => self.close_handshake(fd),
        }
    }

    /// `ATTACH <port> [<host port>]` from the host client on `fd`: hands it a detached
    /// connection to guest port `port` — the one with `host_port` when given, else the lowest
    /// host port first. Returns false when there is none.
    fn attach(&mut self, fd: RawFd, port: u32, host_port: Option<u32>, consumed: usize) -> bool {
        let Some(key) = self
            .conns
            .iter()
            .filter(|(k, c)| {
                k.peer_port == port
                    && c.is_detached()
                    && host_port.is_none_or(|h| k.local_port == h)
            })
            .map(|(k, _)| *k)
            .min()
        else {
            return false;
        };
        let Some(h) = self.handshakes.remove(&fd) else {
            return false;
        };
        let early = h.buf.get(consumed..).unwrap_or_default().to_vec();
        let registered = h.registered;
        let Some(c) = self.conns.get_mut(&key) else {
            return false;
        };
        let v = c.attach(h.stream, early);
        c.registered = registered.then_some(EventSet::IN);
        self.by_fd.insert(fd, key);
        self.metrics.preserved_attached += 1;
        self.settle(key, v);
        true
    }

    /// A plain `CONNECT <port>`: the client wants a new connection, not the kept ones to that
    /// port, so those are reset now (the guest's programs blocked on them get an error and
    /// their sockets go away, as a transport reset would have done). Clients that know about
    /// `ATTACH` use it for every connection; others get the old behaviour.
    fn drop_detached(&mut self, port: u32) {
        let keys: Vec<ConnKey> = self
            .conns
            .iter()
            .filter(|(k, c)| k.peer_port == port && c.is_detached())
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            self.metrics.preserved_dropped += 1;
            self.settle(key, Verdict::Reset(ResetCause::PeerGone));
        }
    }

    /// What a snapshot keeps of the connections: the quiet host-initiated ones (see
    /// [`Connection::preserved`]), and the addresses of all others, which a restore resets.
    pub fn save_connections(&self) -> VsockConnections {
        let mut out = VsockConnections::default();
        for (k, c) in &self.conns {
            match c.preserved() {
                Some(p) => out.preserved.push(p),
                None => out.reset.push((k.local_port, k.peer_port)),
            }
        }
        out.preserved.sort_by_key(|p| (p.local_port, p.peer_port));
        out.reset.sort_unstable();
        out
    }

    /// Restores `saved` into an empty muxer: preserved connections wait detached for an
    /// `ATTACH`, the others get an RST so that the guest drops its sockets.
    pub fn restore_connections(&mut self, saved: &VsockConnections) -> Result<(), String> {
        if saved.preserved.len() + saved.reset.len() > MAX_CONNECTIONS {
            return Err(format!(
                "{} connections saved, at most {MAX_CONNECTIONS} can exist",
                saved.preserved.len() + saved.reset.len()
            ));
        }
        for p in &saved.preserved {
            let c = Connection::detached(p);
            let key = ConnKey {
                local_port: p.local_port,
                peer_port: p.peer_port,
            };
            if self.conns.insert(key, c).is_some() {
                return Err(format!("connection {key:?} saved twice"));
            }
        }
        for &(local_port, peer_port) in &saved.reset {
            self.queue_ctl(Header::to_guest(
                self.guest_cid,
                local_port,
                peer_port,
                op::RST,
            ));
        }
        Ok(())
    }

    /// Connections restored from a snapshot that no host client has attached to yet.
    pub fn detached_count(&self) -> usize {
        self.conns.values().filter(|c| c.is_detached()).count()
    }

    /// Starts host-port allocation at a random point of `[LOCAL_PORT_START, u32::MAX]` (used
    /// after a restore, so that new connections do not reuse the snapshot's port pairs).
    pub fn randomize_next_port(&mut self) {
        let mut b = [0u8; 4];
        // SAFETY: getrandom writes at most `b.len()` bytes into the valid buffer `b`.
        let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), libc::GRND_NONBLOCK) };
        let r = if n == 4 {
            u32::from_le_bytes(b)
        } else {
            // No entropy yet (never the case on a running host): the clock's low bits.
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0)
        };
        self.next_port = LOCAL_PORT_START | (r & !LOCAL_PORT_START);
    }

    fn allocate_port(&mut self, peer_port: u32) -> u32 {
        loop {
            let p = self.next_port;
            self.next_port = if p == u32::MAX {
                LOCAL_PORT_START
            } else {
                p + 1
            };
            // Fewer live connections than ports in the range: this ends.
            if !self.conns.contains_key(&ConnKey {
                local_port: p,
                peer_port,
            }) {
                return p;
            }
        }
    }

    /// An event on a descriptor that is neither a queue, the timer nor the listener.
    pub fn on_fd_event(&mut self, fd: RawFd, set: EventSet, active: bool, now: Instant) -> FdKind {
        if self.handshakes.contains_key(&fd) {
            self.on_handshake(fd, set, active, now);
            return FdKind::Known;
        }
        let Some(&key) = self.by_fd.get(&fd) else {
            return FdKind::Unknown;
        };
        let v = match self.conns.get_mut(&key) {
            Some(c) => c.on_unix_event(set),
            None => return FdKind::Unknown,
        };
        self.settle(key, v);
        FdKind::Known
    }

    /// Deadlines; returns whether any remain (the timer keeps running).
    pub fn on_tick(&mut self, now: Instant) -> bool {
        let unpaused = std::mem::take(&mut self.listener_paused);
        let expired: Vec<RawFd> = self
            .handshakes
            .iter()
            .filter(|(_, h)| h.deadline <= now)
            .map(|(&fd, _)| fd)
            .collect();
        for fd in expired {
            self.close_handshake(fd);
        }
        let mut verdicts = Vec::new();
        let mut any = unpaused || !self.handshakes.is_empty();
        for (k, c) in &mut self.conns {
            match c.on_tick(now) {
                Verdict::Keep => any |= c.has_deadline(),
                v => verdicts.push((*k, v)),
            }
        }
        for (k, v) in verdicts {
            self.settle(k, v);
        }
        any
    }

    /// Whether something waits for an rx buffer.
    pub fn has_rx(&mut self) -> bool {
        if !self.ctl.is_empty() {
            return true;
        }
        while let Some(k) = self.rx_ready.front().copied() {
            match self.conns.get_mut(&k) {
                Some(c) if c.has_rx_work() => return true,
                Some(c) => c.in_rx_queue = false,
                None => {}
            }
            self.rx_ready.pop_front();
        }
        false
    }

    /// The next packet for the guest, payload in `payload`; connections take turns.
    pub fn next_rx_packet(
        &mut self,
        max_payload: usize,
        payload: &mut Vec<u8>,
        now: Instant,
    ) -> Option<(Header, Option<ConnKey>)> {
        if let Some(h) = self.ctl.pop_front() {
            payload.clear();
            return Some((h, None));
        }
        let mut skipped = Vec::new();
        let mut found = None;
        while let Some(k) = self.rx_ready.pop_front() {
            let Some(c) = self.conns.get_mut(&k) else {
                continue;
            };
            c.in_rx_queue = false;
            if let Some(h) = c.next_packet(self.guest_cid, max_payload, payload, now) {
                found = Some((h, Some(k)));
                // Re-queues it at the back if it has more.
                self.settle(k, Verdict::Keep);
                break;
            }
            if c.has_rx_work() {
                // Only data is left and this buffer has no room for any.
                c.in_rx_queue = true;
                skipped.push(k);
            }
        }
        for k in skipped.into_iter().rev() {
            self.rx_ready.push_front(k);
        }
        found
    }

    /// A packet for `key` could not be written to guest memory: its data is lost.
    pub fn reset_conn(&mut self, key: ConnKey) {
        self.settle(key, Verdict::Reset(ResetCause::Protocol));
    }

    /// Brings epoll in line with the state: unregisters and closes retired sockets, registers
    /// new ones, updates interests.
    pub fn sync(&mut self, ops: &mut EventOps) {
        for fd in self.zombies.drain(..) {
            let _ = ops.remove(Events::empty(&fd));
        }
        if let Some(l) = &self.listener {
            let want = if self.listener_paused {
                EventSet::empty()
            } else {
                EventSet::IN
            };
            let r = match self.listener_registered {
                None => ops.add(Events::new(&l.sock, want)),
                Some(cur) if cur != want => ops.modify(Events::new(&l.sock, want)),
                Some(_) => Ok(()),
            };
            match r {
                Ok(()) => self.listener_registered = Some(want),
                Err(e) => crate::error_limited!("vsock: cannot watch the listening socket: {e:?}"),
            }
        }
        let mut failed = Vec::new();
        for h in self.handshakes.values_mut() {
            if !h.registered {
                match ops.add(Events::new(&h.stream, EventSet::IN)) {
                    Ok(()) => h.registered = true,
                    Err(_) => failed.push(h.stream.as_raw_fd()),
                }
            }
        }
        for fd in failed {
            self.close_handshake(fd);
        }
        let mut broken = Vec::new();
        for key in std::mem::take(&mut self.dirty) {
            let Some(c) = self.conns.get_mut(&key) else {
                continue;
            };
            c.dirty = false;
            let Some(fd) = c.unix_fd() else {
                c.registered = None;
                continue;
            };
            let want = c.interest();
            let r = match (c.registered, want) {
                (None, Some(s)) => ops.add(Events::new_raw(fd, s)),
                (Some(cur), Some(s)) if cur != s => ops.modify(Events::new_raw(fd, s)),
                (Some(_), None) => ops.remove(Events::empty_raw(fd)),
                _ => Ok(()),
            };
            match r {
                Ok(()) => c.registered = want,
                Err(e) => {
                    crate::warn_limited!("vsock: epoll update for {key:?} failed: {e:?}");
                    broken.push(key);
                }
            }
        }
        for key in broken {
            self.settle(key, Verdict::Reset(ResetCause::Unix));
        }
        // Resets above may have produced more zombies.
        for fd in self.zombies.drain(..) {
            let _ = ops.remove(Events::empty(&fd));
        }
    }

    /// Connections waiting for the guest's answer.
    #[cfg(test)]
    pub fn connecting_count(&self) -> usize {
        self.conns
            .values()
            .filter(|c| c.state() == super::conn::ConnState::Connecting)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::vsock::conn::CONNECT_TIMEOUT;
    use std::io::Write;

    fn muxer() -> (Muxer, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let m = Muxer::new(3, dir.path().join("v.sock")).unwrap();
        (m, dir)
    }

    fn req(src_port: u32, dst_port: u32) -> Header {
        Header {
            src_cid: 3,
            dst_cid: 2,
            src_port,
            dst_port,
            kind: TYPE_STREAM,
            op: op::REQUEST,
            buf_alloc: 4096,
            ..Header::default()
        }
    }

    #[test]
    fn guest_connect_without_listener_is_reset() {
        let (mut m, _d) = muxer();
        m.on_guest_packet(&req(1000, 9), &[]);
        assert!(m.has_rx());
        let mut p = Vec::new();
        let (h, key) = m.next_rx_packet(4096, &mut p, Instant::now()).unwrap();
        assert_eq!(
            (h.op, h.src_port, h.dst_port, key),
            (op::RST, 9, 1000, None)
        );
        assert_eq!(m.metrics.connect_failures, 1);
        assert!(!m.has_rx());
    }

    #[test]
    fn handshake_line_creates_a_connecting_connection() {
        let (mut m, d) = muxer();
        let mut c = UnixStream::connect(d.path().join("v.sock")).unwrap();
        c.write_all(b"CONNECT 52\nearly").unwrap();
        m.accept(true, Instant::now());
        assert_eq!(m.connecting_count(), 1);
        let mut p = Vec::new();
        let (h, key) = m.next_rx_packet(4096, &mut p, Instant::now()).unwrap();
        assert_eq!(
            (h.op, h.dst_port, h.src_port),
            (op::REQUEST, 52, LOCAL_PORT_START)
        );
        assert!(key.is_some());
        // An inactive device refuses host clients.
        let mut c2 = UnixStream::connect(d.path().join("v.sock")).unwrap();
        c2.write_all(b"CONNECT 52\n").unwrap();
        m.accept(false, Instant::now());
        let mut b = [0u8; 1];
        assert_eq!(c2.read(&mut b).unwrap(), 0);
        // A garbage line is refused too.
        let mut c3 = UnixStream::connect(d.path().join("v.sock")).unwrap();
        c3.write_all(b"HELLO\n").unwrap();
        m.accept(true, Instant::now());
        assert_eq!(c3.read(&mut b).unwrap(), 0);
        assert_eq!(m.connection_count(), 1);
    }

    #[test]
    fn deadlines_close_silent_clients_and_unanswered_requests() {
        let (mut m, d) = muxer();
        let now = Instant::now();
        // A client that never sends its line.
        let mut silent = UnixStream::connect(d.path().join("v.sock")).unwrap();
        m.accept(true, now);
        // A request the guest never answers.
        let mut waiting = UnixStream::connect(d.path().join("v.sock")).unwrap();
        waiting.write_all(b"CONNECT 8\n").unwrap();
        m.accept(true, now);
        let mut p = Vec::new();
        // The request waits for an rx buffer: its time limit starts again on delivery.
        let delivered = now + Duration::from_secs(3);
        assert_eq!(
            m.next_rx_packet(4096, &mut p, delivered).unwrap().0.op,
            op::REQUEST
        );
        assert!(m.on_tick(now + CONNECT_TIMEOUT));
        assert_eq!(m.connection_count(), 1);
        // (The silent client's handshake has expired too: nothing is left to time.)
        assert!(!m.on_tick(delivered + CONNECT_TIMEOUT));
        assert_eq!(m.connection_count(), 0);
        // The guest is told to forget the request.
        assert_eq!(m.next_rx_packet(4096, &mut p, now).unwrap().0.op, op::RST);
        let mut b = [0u8; 1];
        assert_eq!(waiting.read(&mut b).unwrap(), 0);
        assert!(!m.on_tick(now + HANDSHAKE_TIMEOUT));
        assert_eq!(silent.read(&mut b).unwrap(), 0);
    }

    #[test]
    fn port_allocation_skips_live_keys() {
        let (mut m, _d) = muxer();
        m.next_port = u32::MAX;
        assert_eq!(m.allocate_port(1), u32::MAX);
        assert_eq!(m.allocate_port(1), LOCAL_PORT_START);
    }

    /// A guest packet on the connection `key` (guest port `key.peer_port`).
    fn from_guest(key: ConnKey, op: u16) -> Header {
        Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: key.peer_port,
            dst_port: key.local_port,
            kind: TYPE_STREAM,
            op,
            buf_alloc: 64 * 1024,
            ..Header::default()
        }
    }

    /// A host client connected to guest port 52 through `m`, the guest having accepted.
    fn established(m: &mut Muxer, d: &tempfile::TempDir) -> (UnixStream, ConnKey) {
        let mut c = UnixStream::connect(d.path().join("v.sock")).unwrap();
        c.write_all(b"CONNECT 52\n").unwrap();
        m.accept(true, Instant::now());
        let mut p = Vec::new();
        let (h, key) = m.next_rx_packet(4096, &mut p, Instant::now()).unwrap();
        assert_eq!(h.op, op::REQUEST);
        let key = key.unwrap();
        m.on_guest_packet(&from_guest(key, op::RESPONSE), &[]);
        let mut line = [0u8; 14];
        c.read_exact(&mut line).unwrap();
        assert_eq!(&line[..3], b"OK ");
        (c, key)
    }

    /// The muxer of a restored device: the connections `saved`, no host client.
    fn restored(saved: &VsockConnections) -> (Muxer, tempfile::TempDir) {
        let (mut m, d) = muxer();
        m.restore_connections(saved).unwrap();
        (m, d)
    }

    #[test]
    fn snapshots_keep_quiet_host_connections_and_reset_the_rest() {
        let (mut m, d) = muxer();
        let (_c, key) = established(&mut m, &d);
        // A second client whose request the guest has not answered.
        let mut pending = UnixStream::connect(d.path().join("v.sock")).unwrap();
        pending.write_all(b"CONNECT 60\n").unwrap();
        m.accept(true, Instant::now());
        // A guest-initiated connection is never kept (its host peer is this VMM's).
        let l = std::os::unix::net::UnixListener::bind(d.path().join("v.sock_9")).unwrap();
        let gkey = ConnKey {
            local_port: 9,
            peer_port: 7000,
        };
        m.on_guest_packet(&from_guest(gkey, op::REQUEST), &[]);
        drop(l);
        let saved = m.save_connections();
        assert_eq!(saved.preserved.len(), 1, "{saved:?}");
        assert_eq!(
            (saved.preserved[0].local_port, saved.preserved[0].peer_port),
            (key.local_port, 52)
        );
        assert_eq!(saved.reset.len(), 2, "{saved:?}");
        assert!(saved.reset.contains(&(9, 7000)));
        // Restored: the kept one waits; the others are reset in the guest.
        let (mut r, _d2) = restored(&saved);
        assert_eq!(r.detached_count(), 1);
        let mut p = Vec::new();
        let mut rsts = Vec::new();
        while let Some((h, _)) = r.next_rx_packet(4096, &mut p, Instant::now()) {
            assert_eq!(h.op, op::RST);
            rsts.push((h.src_port, h.dst_port));
        }
        rsts.sort_unstable();
        assert_eq!(rsts, saved.reset);
    }

    #[test]
    fn attach_takes_over_a_kept_connection_with_its_stream() {
        let (mut m, d) = muxer();
        let (_c, key) = established(&mut m, &d);
        let saved = m.save_connections();
        let (mut r, d2) = restored(&saved);
        let now = Instant::now();
        // The guest writes before anyone attached: kept for the client.
        r.on_guest_packet(
            &{
                let mut h = from_guest(key, op::RW);
                h.len = 5;
                h
            },
            b"early",
        );
        assert_eq!(r.connection_count(), 1);
        let mut c = UnixStream::connect(d2.path().join("v.sock")).unwrap();
        c.write_all(b"ATTACH 52\nping").unwrap();
        r.accept(true, now);
        assert_eq!(r.detached_count(), 0);
        assert_eq!(r.metrics.preserved_attached, 1);
        // OK with the kept host port, then what the guest sent meanwhile.
        let expect = format!("OK {}\nearly", key.local_port);
        let mut got = vec![0u8; expect.len()];
        c.read_exact(&mut got).unwrap();
        assert_eq!(String::from_utf8_lossy(&got), expect);
        // The client's bytes reach the guest on the kept connection: no REQUEST.
        let mut p = Vec::new();
        let (h, k) = r.next_rx_packet(4096, &mut p, now).unwrap();
        assert_eq!((h.op, k, &p[..]), (op::RW, Some(key), &b"ping"[..]));
        assert_eq!((h.src_port, h.dst_port), (key.local_port, 52));
        // A second ATTACH finds nothing kept: it becomes an ordinary CONNECT.
        let mut c2 = UnixStream::connect(d2.path().join("v.sock")).unwrap();
        c2.write_all(b"ATTACH 52\n").unwrap();
        r.accept(true, now);
        let (h, _) = r.next_rx_packet(4096, &mut p, now).unwrap();
        assert_eq!(h.op, op::REQUEST);
        assert_eq!(r.metrics.preserved_attached, 1);
    }

    #[test]
    fn attach_with_a_host_port_takes_exactly_that_connection() {
        let (mut m, d) = muxer();
        let (_c1, k1) = established(&mut m, &d);
        let (_c2, k2) = established(&mut m, &d);
        assert!(k1.local_port < k2.local_port);
        let saved = m.save_connections();
        let (mut r, d2) = restored(&saved);
        let now = Instant::now();
        // The higher host port, although the lowest would be the default.
        let mut c = UnixStream::connect(d2.path().join("v.sock")).unwrap();
        c.write_all(format!("ATTACH 52 {}\nping", k2.local_port).as_bytes())
            .unwrap();
        r.accept(true, now);
        let expect = format!("OK {}\n", k2.local_port);
        let mut got = vec![0u8; expect.len()];
        c.read_exact(&mut got).unwrap();
        assert_eq!(String::from_utf8_lossy(&got), expect);
        let mut p = Vec::new();
        let (h, k) = r.next_rx_packet(4096, &mut p, now).unwrap();
        assert_eq!((h.op, k), (op::RW, Some(k2)));
        assert_eq!(r.detached_count(), 1);
        // A host port that was not kept: a new connection; the other kept one stays.
        let mut c3 = UnixStream::connect(d2.path().join("v.sock")).unwrap();
        c3.write_all(format!("ATTACH 52 {}\n", k2.local_port).as_bytes())
            .unwrap();
        r.accept(true, now);
        let (h, _) = r.next_rx_packet(4096, &mut p, now).unwrap();
        assert_eq!((h.op, h.dst_port), (op::REQUEST, 52));
        assert_eq!(r.detached_count(), 1);
        assert_eq!(r.metrics.preserved_attached, 1);
        // A plain CONNECT resets the kept one but not the attached one.
        let mut c4 = UnixStream::connect(d2.path().join("v.sock")).unwrap();
        c4.write_all(b"CONNECT 52\n").unwrap();
        r.accept(true, now);
        assert_eq!(r.detached_count(), 0);
        assert_eq!(r.metrics.preserved_dropped, 1);
        let (h, k) = r.next_rx_packet(4096, &mut p, now).unwrap();
        assert_eq!((h.op, h.src_port, k), (op::RST, k1.local_port, None));
        assert!(r.conns.contains_key(&k2));
    }

    #[test]
    fn a_plain_connect_resets_the_kept_connections_to_its_port() {
        let (mut m, d) = muxer();
        let (_c, key) = established(&mut m, &d);
        let saved = m.save_connections();
        let (mut r, d2) = restored(&saved);
        let now = Instant::now();
        let mut c = UnixStream::connect(d2.path().join("v.sock")).unwrap();
        c.write_all(b"CONNECT 52\n").unwrap();
        r.accept(true, now);
        assert_eq!(r.detached_count(), 0);
        assert_eq!(r.metrics.preserved_dropped, 1);
        // The guest is told: RST for the kept one first, then the new request.
        let mut p = Vec::new();
        let (h, k) = r.next_rx_packet(4096, &mut p, now).unwrap();
        assert_eq!((h.op, h.src_port, k), (op::RST, key.local_port, None));
        let (h, _) = r.next_rx_packet(4096, &mut p, now).unwrap();
        assert_eq!((h.op, h.dst_port), (op::REQUEST, 52));
    }

    #[test]
    fn hostile_guests_on_kept_connections_cannot_break_the_device() {
        let (mut m, d) = muxer();
        let (_c, key) = established(&mut m, &d);
        let saved = m.save_connections();
        // RST: forgotten without a reply.
        let (mut r, _d) = restored(&saved);
        r.on_guest_packet(&from_guest(key, op::RST), &[]);
        assert_eq!((r.connection_count(), r.has_rx()), (0, false));
        // A second REQUEST on it, a bogus op: reset.
        for bad in [op::REQUEST, 0xffff, op::RESPONSE] {
            let (mut r, _d) = restored(&saved);
            r.on_guest_packet(&from_guest(key, bad), &[]);
            assert_eq!(r.connection_count(), 0, "op {bad}");
            let mut p = Vec::new();
            assert_eq!(
                r.next_rx_packet(4096, &mut p, Instant::now()).unwrap().0.op,
                op::RST
            );
        }
        // SHUTDOWN(both): closed.
        let (mut r, _d) = restored(&saved);
        let mut sd = from_guest(key, op::SHUTDOWN);
        sd.flags = super::super::packet::shutdown::BOTH;
        r.on_guest_packet(&sd, &[]);
        assert_eq!(r.connection_count(), 0);
        // Data beyond the credit while nobody is attached: reset, not buffered without bound.
        let (mut r, _d) = restored(&saved);
        let chunk = vec![0u8; 64 * 1024];
        let mut h = from_guest(key, op::RW);
        h.len = chunk.len() as u32;
        for _ in 0..8 {
            r.on_guest_packet(&h, &chunk);
        }
        assert_eq!(r.connection_count(), 0);
        assert_eq!(r.metrics.credit_violations, 1);
        // A state that lists one connection twice, or too many, is refused.
        let mut twice = saved.clone();
        twice.preserved.push(twice.preserved[0]);
        let (mut m2, _d) = muxer();
        assert!(m2.restore_connections(&twice).is_err());
        let many = VsockConnections {
            preserved: vec![],
            reset: vec![(1, 1); MAX_CONNECTIONS + 1],
        };
        assert!(m2.restore_connections(&many).is_err());
    }

    #[test]
    fn control_replies_are_bounded() {
        let (mut m, _d) = muxer();
        let mut h = req(1, 2);
        h.op = op::RW;
        for _ in 0..MAX_CTL_REPLIES + 10 {
            m.on_guest_packet(&h, &[]);
        }
        assert_eq!(m.ctl.len(), MAX_CTL_REPLIES);
        assert_eq!(m.metrics.replies_dropped, 10);
    }
}

//! virtio-vsock (device type 19) with a Unix-socket backend on the host; no vhost.
//!
//! Host side, per [`VsockConfig`]:
//! - The device listens on `uds_path` (a stale socket file there is replaced; a live one is
//!   not). A host process connects and sends `CONNECT <port>\n`; the device sends the guest a
//!   connection request for that guest port and, once the guest accepts, answers
//!   `OK <hostport>\n` on the Unix socket (`hostport`: the host-side port the device allocated,
//!   from 2^30 up) and the stream is open. If the guest refuses (RST) or does not answer within
//!   2 s, the Unix socket is closed without an `OK`. A client gets 5 s to send its line.
//! - `ATTACH <port>\n` instead takes over a connection to that guest port which the snapshot
//!   this device was restored from kept (see *Snapshots*): the device answers
//!   `OK <hostport>\n` at once and the stream continues where it was — the guest sees nothing
//!   until the client's first bytes, which a program already blocked in `read` on its socket
//!   gets without an `accept` or a new socket. With no kept connection to that port left,
//!   `ATTACH` works as `CONNECT`. A plain `CONNECT` resets the kept connections to its port
//!   that are still detached (their guest programs are freed, as a transport reset would
//!   have done), so clients that never `ATTACH` see the old behaviour. `ATTACH` is for
//!   clients that know the snapshot's connections to that port were idle (e.g. the agent's
//!   pooled connections, between calls): it continues whatever stream it finds.
//! - A guest connection to host port P (CID 2) connects (non-blocking) to the Unix socket
//!   `<uds_path>_P`; if that fails (nobody listens, backlog full) the guest gets RST.
//!
//! Queues: rx (0, device → guest), tx (1, guest → device), event (2), 256 entries each. Config
//! space: `le64 guest_cid`. Features: `VIRTIO_F_VERSION_1` only (stream sockets; no SEQPACKET).
//!
//! # Event loop
//! The device is a `MutEventSubscriber` on the VMM's event loop and owns no thread. It watches
//! its three queue eventfds, a kick eventfd (work asked for from outside the loop: activation,
//! reset, transport reset, new socket path), a timerfd (armed only while a deadline is pending),
//! the listening socket and each connection's Unix socket; every descriptor is non-blocking.
//! Unix sockets are added, modified and removed through the `EventOps` of `process` as
//! connections come and go; a socket still registered with epoll is always unregistered before
//! it is closed.
//!
//! # Flow control and backpressure
//! Per connection, both directions use the virtio credit scheme (`buf_alloc`, `fwd_cnt`,
//! `tx_cnt`):
//! - Host → guest: the device never has more than the guest's `buf_alloc - (tx_cnt - fwd_cnt)`
//!   bytes in flight, and it reads the Unix socket only up to that credit (at most 64 KiB ahead).
//!   A guest that stops reading therefore makes the device stop reading that socket (its
//!   `EPOLLIN` interest is dropped until a credit update arrives); the host writer then blocks
//!   on its own socket buffer. When credit runs out the device sends one `CREDIT_REQUEST`.
//! - Guest → host: the device advertises 256 KiB per connection. Guest data goes straight into
//!   the Unix socket; whatever the socket does not take (`EAGAIN`) waits in a per-connection
//!   buffer that the credit bounds to 256 KiB, and `EPOLLOUT` is watched until it drains.
//!   `fwd_cnt` counts bytes that reached the socket; a `CREDIT_UPDATE` goes out when the guest
//!   may believe it has less than 64 KiB of room left (and every packet to the guest carries the
//!   current `fwd_cnt`). The shared tx queue is always drained: one slow Unix reader never holds
//!   up other connections' packets. A guest that sends beyond its credit is reset.
//! - Packets wait for rx buffers in a round robin over connections (control replies first), so
//!   one busy connection cannot starve the others; with no rx buffers at all nothing is read
//!   from Unix sockets beyond the bounded read-ahead, and tx keeps flowing.
//!
//! Worst-case host memory: 512 connections (the limit; more are refused with RST or a closed
//! socket) × (256 KiB + 64 KiB), reached only if host peers stop reading and the guest posts
//! no rx buffers.
//!
//! # Shutdown
//! A guest SHUTDOWN(SEND) becomes `shutdown(SHUT_WR)` on the Unix socket once buffered data is
//! written; SHUTDOWN(RCV) drops read-ahead data and becomes `shutdown(SHUT_RD)`; SHUTDOWN with
//! both flags is answered with RST after the buffered data is out. Unix EOF becomes
//! SHUTDOWN(SEND) after the last data; a Unix peer that hung up becomes SHUTDOWN(both) after the
//! last data, and the connection waits up to 4 s for the guest's RST before sending its own.
//! Unix errors reset the connection.
//!
//! # Hostile guest
//! Every chain is validated: a readable, complete 44-byte header; payload length within the
//! chain and at most 64 KiB; `src_cid` = the guest's CID and `dst_cid` = 2; op and socket type
//! valid for the connection's state. Chains that cannot be parsed are completed and counted
//! (`malformed`, `bad_address`); protocol errors are answered with RST (and reset the
//! connection they name); rx and event buffers that cannot hold a packet are completed empty.
//! Nothing a guest sends can panic the device or make it allocate without bound.
//!
//! # Snapshots
//! [`VsockState`] holds the queues and the connections ([`VsockConnections`]): the
//! *established, quiet, host-initiated* ones (nothing buffered either way, no shutdown under
//! way) with their credit counters, and the addresses of all others. A restored device (same
//! CID) recreates the quiet ones *detached* — no host socket; guest data waits within the
//! guest's credit — until a host client `ATTACH`es, and sends an RST for each of the others, so
//! the guest drops exactly those sockets; no transport reset is sent, and nothing else
//! changes in the guest. Each clone gets its own copy of a kept connection on its own host
//! socket, so clones never share a stream; the guest's clock and entropy are still the
//! host's to refresh (the agent's `sync`). Snapshots of format 1 ([`VsockStateV1`]), a changed
//! CID, or the VMM's `--vsock-transport-reset` drop every connection instead and put
//! `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET` on the event queue, so that the guest drops all its
//! sockets (and re-reads its CID). [`Vsock::send_transport_reset`] and [`Vsock::set_uds_path`]
//! do the same for a running device.
//!
//! A hostile guest gains nothing from kept connections: it can reset, shut down or flood one
//! like any other (the same state machine and credit limits apply, detached or not), and a
//! host client that attaches reads whatever the guest sends, as on any connection.

mod conn;
mod muxer;
pub mod packet;
mod unix;

use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use event_manager::{EventOps, Events, MutEventSubscriber};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use super::{device_type, interrupt_cause, ActivateError, Interrupt, QueueSnapshot, VirtioDevice};
use crate::GuestMemoryMmap;

pub use conn::PreservedConn;
pub use conn::{CONN_BUF_ALLOC, STAGING_MAX};
pub use muxer::{VsockConnections, LOCAL_PORT_START, MAX_CONNECTIONS};
pub use packet::{HDR_LEN, MAX_PKT_PAYLOAD, VSOCK_HOST_CID};

use muxer::{FdKind, Muxer};
use packet::{Header, EVENT_TRANSPORT_RESET};

/// Size of each of the three queues.
pub const QUEUE_SIZE: u16 = 256;
/// Queue indices.
pub const RX_QUEUE: usize = 0;
/// The guest's transmit queue.
pub const TX_QUEUE: usize = 1;
/// The event queue.
pub const EVENT_QUEUE: usize = 2;
/// Longest wait for the guest to acknowledge a transport reset before rx traffic flows anyway.
pub const RESET_ACK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);
const NUM_QUEUES: usize = 3;
/// Tx chains handled per wake-up before yielding to other event sources.
const TX_BUDGET: usize = 2 * QUEUE_SIZE as usize;
/// Period of the housekeeping timer while any deadline is pending.
const TICK: Duration = Duration::from_millis(250);

/// Configuration of the vsock device.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    /// The guest's context id (3 or more).
    pub guest_cid: u64,
    /// Host Unix socket: host-initiated connections connect here and send `CONNECT <port>\n`;
    /// guest connections to host port P go to `<uds_path>_P`.
    pub uds_path: PathBuf,
}

/// Errors building or restoring the device.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    /// The CID is reserved (0, 1, 2) or does not fit the 32 bits guests use.
    #[error("vsock guest CID {0} is invalid: it must be between 3 and 4294967294")]
    InvalidCid(u64),
    /// The listening socket cannot be created.
    #[error("cannot listen on vsock socket {path}: {source}")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// An eventfd or timerfd could not be made.
    #[error("cannot create the vsock device's {what}: {source}")]
    Fd {
        /// Which descriptor.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
    /// The snapshot state is inconsistent.
    #[error("vsock snapshot state is invalid: {0}")]
    State(String),
    /// A queue in the snapshot state is invalid.
    #[error("vsock snapshot queue {index} is invalid: {source}")]
    Queue {
        /// The queue.
        index: usize,
        /// Why.
        source: ActivateError,
    },
}

/// Counters, for stats and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct VsockMetrics {
    /// Well-formed packets taken from the tx queue.
    pub tx_packets: u64,
    /// Payload bytes the guest sent.
    pub tx_bytes: u64,
    /// Packets delivered to the guest.
    pub rx_packets: u64,
    /// Payload bytes delivered to the guest.
    pub rx_bytes: u64,
    /// Chains dropped as malformed: short header, bad payload length, unusable buffers.
    pub malformed: u64,
    /// Packets dropped for a wrong source or destination CID.
    pub bad_address: u64,
    /// Connections opened (both directions).
    pub conns_opened: u64,
    /// Connections closed or reset.
    pub conns_closed: u64,
    /// RST packets queued for the guest.
    pub resets_sent: u64,
    /// Connections reset because the guest sent beyond its credit.
    pub credit_violations: u64,
    /// Guest connection requests that found no host socket (or hit the connection limit).
    pub connect_failures: u64,
    /// Control replies dropped because the guest posted no rx buffers for too long.
    pub replies_dropped: u64,
    /// Transport-reset events delivered.
    pub transport_resets: u64,
    /// Connections a restore kept from the snapshot (waiting for `ATTACH`).
    pub preserved_restored: u64,
    /// Of those, connections a host client took over with `ATTACH`.
    pub preserved_attached: u64,
    /// Connections a restore reset one by one (instead of a transport reset).
    pub restore_resets: u64,
    /// Kept connections reset because a host client asked for a new connection to their
    /// port with a plain `CONNECT`.
    pub preserved_dropped: u64,
}

/// The vsock device's snapshot state.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VsockState {
    /// The guest CID when saved (a restore may change it: the transport reset makes the guest
    /// read it again).
    pub guest_cid: u64,
    /// Features the driver accepted.
    pub acked_features: u64,
    /// Whether the driver had started the device.
    pub activated: bool,
    /// rx, tx and event queues (empty when not activated).
    pub queues: Vec<QueueSnapshot>,
    /// The connections: `None` in snapshots of older builds ([`VsockStateV1`]), whose
    /// restores send a transport reset instead.
    pub connections: Option<VsockConnections>,
}

/// The device state as snapshot format version 1 stored it (no connections).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VsockStateV1 {
    /// See [`VsockState::guest_cid`].
    pub guest_cid: u64,
    /// See [`VsockState::acked_features`].
    pub acked_features: u64,
    /// See [`VsockState::activated`].
    pub activated: bool,
    /// See [`VsockState::queues`].
    pub queues: Vec<QueueSnapshot>,
}

impl From<VsockStateV1> for VsockState {
    fn from(v: VsockStateV1) -> Self {
        Self {
            guest_cid: v.guest_cid,
            acked_features: v.acked_features,
            activated: v.activated,
            queues: v.queues,
            connections: None,
        }
    }
}

struct Active {
    mem: GuestMemoryMmap,
    interrupt: Arc<Interrupt>,
    queues: Vec<Queue>,
}

/// A virtio-vsock device.
pub struct Vsock {
    config: VsockConfig,
    acked: u64,
    queue_evts: [EventFd; NUM_QUEUES],
    kick: EventFd,
    timer: TimerFd,
    timer_armed: bool,
    active: Option<Active>,
    broken: bool,
    muxer: Muxer,
    reset_event_pending: bool,
    /// After a transport reset reached the guest: rx traffic (new host connections) waits
    /// until the guest refills its event queue — which it does after resetting its sockets —
    /// or this deadline passes. Without the wait a host connection made right after a restore
    /// can be torn down by the guest's late reset handling.
    reset_ack_deadline: Option<Instant>,
    scratch: Vec<u8>,
    notify: [bool; NUM_QUEUES],
    /// Called once, at the first data packet the guest sends (see [`Vsock::on_first_guest_data`]).
    first_data_hook: Option<Box<dyn FnOnce() + Send>>,
}

impl std::fmt::Debug for Vsock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vsock")
            .field("config", &self.config)
            .field("activated", &self.active.is_some())
            .field("connections", &self.muxer.connection_count())
            .field("metrics", &self.muxer.metrics)
            .finish_non_exhaustive()
    }
}

fn check_cid(cid: u64) -> Result<(), VsockError> {
    if (3..=0xffff_fffe).contains(&cid) {
        Ok(())
    } else {
        Err(VsockError::InvalidCid(cid))
    }
}

fn eventfd(what: &'static str) -> Result<EventFd, VsockError> {
    EventFd::new(libc::EFD_NONBLOCK).map_err(|source| VsockError::Fd { what, source })
}

fn nonblocking_timer() -> Result<TimerFd, VsockError> {
    let err = |source| VsockError::Fd {
        what: "timerfd",
        source,
    };
    let timer = TimerFd::new().map_err(|e| err(std::io::Error::from(e)))?;
    let fd = timer.as_raw_fd();
    // SAFETY: fcntl(F_GETFL) on a descriptor we own; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(err(std::io::Error::last_os_error()));
    }
    // SAFETY: fcntl(F_SETFL) on a descriptor we own; no memory is passed.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(err(std::io::Error::last_os_error()));
    }
    Ok(timer)
}

impl Vsock {
    /// Checks the CID and listens on `config.uds_path` (a stale socket file there is replaced).
    pub fn new(config: VsockConfig) -> Result<Self, VsockError> {
        check_cid(config.guest_cid)?;
        let queue_evts = [
            eventfd("rx eventfd")?,
            eventfd("tx eventfd")?,
            eventfd("event eventfd")?,
        ];
        let kick = eventfd("kick eventfd")?;
        let timer = nonblocking_timer()?;
        // Last: from here on the socket file exists and `Drop` removes it.
        let muxer = Muxer::new(config.guest_cid, config.uds_path.clone()).map_err(|source| {
            VsockError::Bind {
                path: config.uds_path.clone(),
                source,
            }
        })?;
        Ok(Self {
            acked: 0,
            queue_evts,
            kick,
            timer,
            timer_armed: false,
            active: None,
            broken: false,
            muxer,
            reset_event_pending: false,
            reset_ack_deadline: None,
            scratch: Vec::with_capacity(MAX_PKT_PAYLOAD),
            notify: [false; NUM_QUEUES],
            first_data_hook: None,
            config,
        })
    }

    /// The configuration (with the current socket path).
    pub fn config(&self) -> &VsockConfig {
        &self.config
    }

    /// Counters.
    pub fn metrics(&self) -> VsockMetrics {
        self.muxer.metrics
    }

    /// Live connections.
    pub fn connection_count(&self) -> usize {
        self.muxer.connection_count()
    }

    /// Connections restored from a snapshot that wait for a host client's `ATTACH`.
    pub fn detached_count(&self) -> usize {
        self.muxer.detached_count()
    }

    /// Drops every connection (host peers see EOF) and tells the guest to drop its own:
    /// `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET` goes on the event queue now, or as soon as the guest
    /// posts an event buffer. Used after a snapshot is restored (clones must not share streams).
    pub fn send_transport_reset(&mut self) {
        self.muxer.drop_all();
        self.reset_event_pending = true;
        self.deliver_events();
        self.signal();
        self.wake();
    }

    /// Listens on `path` from now on (the old socket file is removed if it is still ours).
    /// Open connections are kept; combine with [`Vsock::send_transport_reset`] to start afresh.
    pub fn set_uds_path(&mut self, path: PathBuf) -> Result<(), VsockError> {
        self.muxer
            .retarget(path.clone())
            .map_err(|source| VsockError::Bind {
                path: path.clone(),
                source,
            })?;
        self.config.uds_path = path;
        self.wake();
        Ok(())
    }

    /// Runs `hook` (on the event loop) when the guest next sends data on any connection — after
    /// a restore, the guest's first answer. The VMM uses it to report what the guest cost until
    /// then.
    pub fn on_first_guest_data(&mut self, hook: Box<dyn FnOnce() + Send>) {
        self.first_data_hook = Some(hook);
    }

    /// Asks the event loop to run `process` (for work requested from outside it).
    fn wake(&self) {
        if let Err(e) = self.kick.write(1) {
            crate::warn_limited!("vsock: cannot wake the event loop: {e}");
        }
    }

    fn mark_broken(&mut self, queue: usize, e: &virtio_queue::Error) {
        crate::warn_limited!("vsock: queue {queue} is broken ({e}); device needs reset");
        self.broken = true;
        if let Some(a) = &self.active {
            a.interrupt.trigger(interrupt_cause::CONFIG);
        }
    }

    /// Takes every packet the guest queued for transmission.
    fn process_tx(&mut self) {
        for _ in 0..TX_BUDGET {
            if self.broken {
                return;
            }
            let Some(active) = self.active.as_mut() else {
                return;
            };
            let mem = &active.mem;
            let chain = match active.queues[TX_QUEUE].iter(mem) {
                Ok(mut it) => it.next(),
                Err(e) => {
                    self.mark_broken(TX_QUEUE, &e);
                    return;
                }
            };
            let Some(chain) = chain else {
                return;
            };
            let head = chain.head_index();
            let parsed = parse_tx(mem, chain, self.muxer.guest_cid, &mut self.scratch);
            if let Err(e) = active.queues[TX_QUEUE].add_used(mem, head, 0) {
                crate::warn_limited!("vsock: cannot complete tx chain {head}: {e}");
            }
            self.notify[TX_QUEUE] = true;
            let m = &mut self.muxer.metrics;
            match parsed {
                TxPacket::Ok(h) => {
                    m.tx_packets += 1;
                    m.tx_bytes += u64::from(h.len);
                    if h.op == packet::op::RW && h.len > 0 {
                        if let Some(hook) = self.first_data_hook.take() {
                            hook();
                        }
                    }
                    self.muxer.on_guest_packet(&h, &self.scratch);
                }
                TxPacket::Malformed => m.malformed += 1,
                TxPacket::BadAddress => m.bad_address += 1,
                TxPacket::BadPayload(h) => {
                    m.malformed += 1;
                    self.muxer.on_guest_bad_payload(&h);
                }
            }
        }
        // More may be waiting: come back after the other event sources had a turn.
        let _ = self.queue_evts[TX_QUEUE].write(1);
    }

    /// Fills rx buffers with whatever waits for the guest.
    fn deliver_rx(&mut self, now: Instant) {
        if let Some(deadline) = self.reset_ack_deadline {
            if now < deadline {
                return;
            }
            self.reset_ack_deadline = None;
        }
        loop {
            if self.broken || self.active.is_none() || !self.muxer.has_rx() {
                return;
            }
            let Some(active) = self.active.as_mut() else {
                return;
            };
            let mem = &active.mem;
            let chain = match active.queues[RX_QUEUE].iter(mem) {
                Ok(mut it) => it.next(),
                Err(e) => {
                    self.mark_broken(RX_QUEUE, &e);
                    return;
                }
            };
            let Some(chain) = chain else {
                // No buffers: the guest will notify the rx queue when it posts some.
                return;
            };
            let head = chain.head_index();
            let mut used = 0u32;
            match chain.writer(mem) {
                Ok(mut w) if w.available_bytes() >= HDR_LEN => {
                    let max = (w.available_bytes() - HDR_LEN).min(MAX_PKT_PAYLOAD);
                    if let Some((h, key)) = self.muxer.next_rx_packet(max, &mut self.scratch, now) {
                        let written = w.write_all(&h.to_bytes()).is_ok()
                            && w.write_all(&self.scratch).is_ok();
                        if written {
                            used = u32::try_from(HDR_LEN + self.scratch.len()).unwrap_or(0);
                            let m = &mut self.muxer.metrics;
                            m.rx_packets += 1;
                            m.rx_bytes += self.scratch.len() as u64;
                        } else {
                            self.muxer.metrics.malformed += 1;
                            if let Some(k) = key {
                                self.muxer.reset_conn(k);
                            }
                        }
                    } else {
                        // Only data waits and this buffer has no room for any.
                        self.muxer.metrics.malformed += 1;
                    }
                }
                _ => self.muxer.metrics.malformed += 1,
            }
            if let Err(e) = active.queues[RX_QUEUE].add_used(mem, head, used) {
                crate::warn_limited!("vsock: cannot complete rx chain {head}: {e}");
            }
            self.notify[RX_QUEUE] = true;
        }
    }

    /// Puts a pending transport-reset event on the event queue.
    fn deliver_events(&mut self) {
        while self.reset_event_pending && !self.broken {
            let Some(active) = self.active.as_mut() else {
                return;
            };
            let mem = &active.mem;
            let chain = match active.queues[EVENT_QUEUE].iter(mem) {
                Ok(mut it) => it.next(),
                Err(e) => {
                    self.mark_broken(EVENT_QUEUE, &e);
                    return;
                }
            };
            let Some(chain) = chain else {
                return;
            };
            let head = chain.head_index();
            let id = EVENT_TRANSPORT_RESET.to_le_bytes();
            let written = match chain.writer(mem) {
                Ok(mut w) => w.available_bytes() >= id.len() && w.write_all(&id).is_ok(),
                Err(_) => false,
            };
            let used = if written {
                self.reset_event_pending = false;
                self.reset_ack_deadline = Some(Instant::now() + RESET_ACK_TIMEOUT);
                self.muxer.timer_wanted = true;
                self.muxer.metrics.transport_resets += 1;
                id.len() as u32
            } else {
                self.muxer.metrics.malformed += 1;
                0
            };
            if let Err(e) = active.queues[EVENT_QUEUE].add_used(mem, head, used) {
                crate::warn_limited!("vsock: cannot complete event chain {head}: {e}");
            }
            self.notify[EVENT_QUEUE] = true;
        }
    }

    /// Raises the interrupt if a used ring changed and the driver wants to know.
    fn signal(&mut self) {
        let Some(active) = self.active.as_mut() else {
            self.notify = [false; NUM_QUEUES];
            return;
        };
        let mut raise = false;
        for (i, q) in active.queues.iter_mut().enumerate() {
            if std::mem::take(&mut self.notify[i]) {
                raise |= q.needs_notification(&active.mem).unwrap_or(true);
            }
        }
        if raise {
            active.interrupt.trigger(interrupt_cause::VRING);
        }
    }

    fn update_timer(&mut self) {
        if self.muxer.timer_wanted && !self.timer_armed {
            match self.timer.reset(TICK, Some(TICK)) {
                Ok(()) => self.timer_armed = true,
                Err(e) => crate::warn_limited!("vsock: cannot arm the timer: {e}"),
            }
        }
        self.muxer.timer_wanted = false;
    }

    fn on_timer(&mut self, now: Instant) {
        // Non-blocking: a stale readiness report is harmless.
        let _ = self.timer.wait();
        let muxer_wants = self.muxer.on_tick(now);
        if !muxer_wants
            && self.reset_ack_deadline.is_none()
            && self.timer_armed
            && self.timer.clear().is_ok()
        {
            self.timer_armed = false;
        }
    }

    fn own_fds(&self) -> [RawFd; NUM_QUEUES + 2] {
        [
            self.queue_evts[RX_QUEUE].as_raw_fd(),
            self.queue_evts[TX_QUEUE].as_raw_fd(),
            self.queue_evts[EVENT_QUEUE].as_raw_fd(),
            self.kick.as_raw_fd(),
            self.timer.as_raw_fd(),
        ]
    }
}

/// What a tx chain held.
enum TxPacket {
    /// A well-addressed packet; its payload is in the scratch buffer.
    Ok(Header),
    /// Not even a header.
    Malformed,
    /// Not from our guest or not for the host.
    BadAddress,
    /// A well-addressed header whose payload is missing or too long.
    BadPayload(Header),
}

fn parse_tx(
    mem: &GuestMemoryMmap,
    chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>,
    guest_cid: u64,
    payload: &mut Vec<u8>,
) -> TxPacket {
    use std::io::Read;
    payload.clear();
    let Ok(mut r) = chain.reader(mem) else {
        return TxPacket::Malformed;
    };
    let mut raw = [0u8; HDR_LEN];
    if r.available_bytes() < HDR_LEN || r.read_exact(&mut raw).is_err() {
        return TxPacket::Malformed;
    }
    let h = Header::from_bytes(&raw);
    if h.src_cid != guest_cid || h.dst_cid != VSOCK_HOST_CID {
        return TxPacket::BadAddress;
    }
    let len = h.len as usize;
    if len > MAX_PKT_PAYLOAD || len > r.available_bytes() {
        return TxPacket::BadPayload(h);
    }
    payload.resize(len, 0);
    if r.read_exact(payload).is_err() {
        payload.clear();
        return TxPacket::BadPayload(h);
    }
    TxPacket::Ok(h)
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        device_type::VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; NUM_QUEUES]
    }

    fn avail_features(&self) -> u64 {
        super::VIRTIO_F_VERSION_1
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked = features & self.avail_features();
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::read_config_bytes(&self.config.guest_cid.to_le_bytes(), offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        crate::debug_limited!("vsock: config write at {offset:#x} ignored");
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
        queues: Vec<Queue>,
    ) -> Result<(), ActivateError> {
        if queues.len() != NUM_QUEUES {
            return Err(ActivateError::QueueCount {
                expected: NUM_QUEUES,
                found: queues.len(),
            });
        }
        self.active = Some(Active {
            mem,
            interrupt,
            queues,
        });
        self.broken = false;
        // Packets may already be waiting: let the event loop look.
        self.wake();
        Ok(())
    }

    fn reset(&mut self) {
        self.muxer.drop_all();
        self.active = None;
        self.broken = false;
        self.acked = 0;
        self.reset_event_pending = false;
        self.notify = [false; NUM_QUEUES];
        self.wake();
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evts
    }

    fn is_activated(&self) -> bool {
        self.active.is_some()
    }
}

impl MutEventSubscriber for Vsock {
    fn init(&mut self, ops: &mut EventOps) {
        let fds = self.own_fds();
        for fd in fds {
            if let Err(e) = ops.add(Events::new_raw(fd, EventSet::IN)) {
                tracing::error!("vsock: cannot watch descriptor {fd}: {e:?}");
            }
        }
        self.muxer.sync(ops);
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        let set = events.event_set();
        let now = Instant::now();
        let [rx, tx, ev, kick, timer] = self.own_fds();
        let active = self.active.is_some();
        if fd == rx || fd == ev {
            // New rx or event buffers: delivered below. An event-queue refill after a transport
            // reset means the guest has handled it.
            if fd == ev {
                self.reset_ack_deadline = None;
            }
            let _ = self.queue_evts[if fd == rx { RX_QUEUE } else { EVENT_QUEUE }].read();
        } else if fd == tx {
            let _ = self.queue_evts[TX_QUEUE].read();
            self.process_tx();
        } else if fd == kick {
            let _ = self.kick.read();
            self.process_tx();
        } else if fd == timer {
            self.on_timer(now);
        } else if Some(fd) == self.muxer.listener_fd() {
            self.muxer.accept(active, now);
        } else if self.muxer.on_fd_event(fd, set, active, now) == FdKind::Unknown {
            // A descriptor we no longer track (it was replaced): stop watching it.
            let _ = ops.remove(Events::empty_raw(fd));
        }
        self.deliver_events();
        self.deliver_rx(now);
        self.muxer.sync(ops);
        self.update_timer();
        self.signal();
    }
}

impl Drop for Vsock {
    fn drop(&mut self) {
        self.muxer.unlink_listener();
    }
}

impl ember_snapshot::Persist for Vsock {
    type State = VsockState;
    type ConstructorArgs = (VsockConfig, Option<(GuestMemoryMmap, Arc<Interrupt>)>);
    type Error = VsockError;

    fn save(&self) -> VsockState {
        VsockState {
            guest_cid: self.config.guest_cid,
            acked_features: self.acked,
            activated: self.active.is_some(),
            queues: self
                .active
                .as_ref()
                .map(|a| a.queues.iter().map(QueueSnapshot::from).collect())
                .unwrap_or_default(),
            connections: self.active.is_some().then(|| self.muxer.save_connections()),
        }
    }

    /// Rebuilds the device listening on `config.uds_path` with `config.guest_cid`. An activated
    /// device resumes on the given memory and interrupt. When the state lists its connections
    /// and the CID is unchanged, the quiet ones are kept (detached, for `ATTACH`) and the
    /// others reset one by one; otherwise (older snapshots, a new CID) a transport reset is
    /// queued for the guest (delivered now if an event buffer is posted).
    fn restore(
        (config, resources): Self::ConstructorArgs,
        state: &VsockState,
    ) -> Result<Self, VsockError> {
        check_cid(state.guest_cid)
            .map_err(|_| VsockError::State(format!("saved guest CID {}", state.guest_cid)))?;
        let offered = super::VIRTIO_F_VERSION_1;
        if state.acked_features & !offered != 0 {
            return Err(VsockError::State(format!(
                "acked features {:#x} were never offered ({offered:#x})",
                state.acked_features
            )));
        }
        // Validate everything before binding the socket.
        let active = if state.activated {
            let Some((mem, interrupt)) = resources else {
                return Err(VsockError::State(
                    "the device was active but no guest memory was given".into(),
                ));
            };
            if state.queues.len() != NUM_QUEUES {
                return Err(VsockError::State(format!(
                    "{} queues saved, the device has {NUM_QUEUES}",
                    state.queues.len()
                )));
            }
            let mut queues = Vec::with_capacity(NUM_QUEUES);
            for (index, s) in state.queues.iter().enumerate() {
                let q = s
                    .to_queue(Some(&mem))
                    .map_err(|source| VsockError::Queue { index, source })?;
                if !q.ready() || q.max_size() != QUEUE_SIZE {
                    return Err(VsockError::Queue {
                        index,
                        source: ActivateError::InvalidQueue(index),
                    });
                }
                queues.push(q);
            }
            Some(Active {
                mem,
                interrupt,
                queues,
            })
        } else {
            None
        };
        let mut dev = Vsock::new(config)?;
        // The guest may still hold sockets of connections made before the snapshot (reset by
        // the transport reset, but closed only when their owner next runs). A new host
        // connection on the same port pair would land on such a stale socket and be refused,
        // so a restored device allocates host ports from a random point of the range.
        dev.muxer.randomize_next_port();
        dev.acked = state.acked_features;
        if let Some(a) = active {
            dev.active = Some(a);
            match &state.connections {
                Some(saved) if state.guest_cid == dev.config.guest_cid => {
                    dev.muxer
                        .restore_connections(saved)
                        .map_err(VsockError::State)?;
                    let m = &mut dev.muxer.metrics;
                    m.preserved_restored = saved.preserved.len() as u64;
                    m.restore_resets = saved.reset.len() as u64;
                    dev.deliver_rx(Instant::now());
                }
                _ => {
                    dev.reset_event_pending = true;
                    dev.deliver_events();
                }
            }
            dev.signal();
            dev.wake();
        }
        Ok(dev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::legacy::EventTrigger;
    use ember_snapshot::Persist;
    use vm_memory::GuestAddress;

    fn cfg(dir: &tempfile::TempDir, cid: u64) -> VsockConfig {
        VsockConfig {
            guest_cid: cid,
            uds_path: dir.path().join("v.sock"),
        }
    }

    #[test]
    fn identity_features_and_config_space() {
        let d = tempfile::tempdir().unwrap();
        let dev = Vsock::new(cfg(&d, 3)).unwrap();
        assert_eq!(dev.device_type(), 19);
        assert_eq!(dev.queue_max_sizes(), &[256, 256, 256]);
        assert_eq!(dev.avail_features(), super::super::VIRTIO_F_VERSION_1);
        let mut b = [0u8; 8];
        dev.read_config(0, &mut b);
        assert_eq!(u64::from_le_bytes(b), 3);
        let mut hi = [0xffu8; 4];
        dev.read_config(4, &mut hi);
        assert_eq!(hi, [0; 4]);
        assert!(d.path().join("v.sock").exists());
        drop(dev);
        assert!(!d.path().join("v.sock").exists());
    }

    #[test]
    fn reserved_cids_are_refused() {
        let d = tempfile::tempdir().unwrap();
        for cid in [0, 1, 2, 0xffff_ffff, 1 << 40] {
            assert!(matches!(
                Vsock::new(cfg(&d, cid)),
                Err(VsockError::InvalidCid(_))
            ));
        }
        let bad = VsockConfig {
            guest_cid: 3,
            uds_path: d.path().join("missing-dir/v.sock"),
        };
        assert!(matches!(Vsock::new(bad), Err(VsockError::Bind { .. })));
    }

    #[test]
    fn activation_needs_three_queues() {
        let d = tempfile::tempdir().unwrap();
        let mut dev = Vsock::new(cfg(&d, 3)).unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let irq = Arc::new(Interrupt::new(EventTrigger::new().unwrap()));
        let r = dev.activate(mem, irq, vec![Queue::new(256).unwrap()]);
        assert!(matches!(
            r,
            Err(ActivateError::QueueCount {
                expected: 3,
                found: 1
            })
        ));
        assert!(!dev.is_activated());
    }

    /// Parses one tx chain built with virtio-queue's `MockSplitQueue`.
    fn parse(descs: &[(u64, u32, u16)], hdr: &Header, payload: &[u8]) -> (TxPacket, Vec<u8>) {
        use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
        use virtio_queue::mock::MockSplitQueue;
        use vm_memory::Bytes;
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        // The wire bytes, spread over the readable descriptors in order.
        let mut wire = hdr.to_bytes().to_vec();
        wire.extend_from_slice(payload);
        let mut off = 0;
        for &(addr, len, flags) in descs {
            if flags & 2 == 0 {
                let end = (off + len as usize).min(wire.len());
                if off < end {
                    // (Descriptors outside memory stay unwritten.)
                    let _ = mem.write_slice(&wire[off..end], GuestAddress(addr));
                }
                off = end;
            }
        }
        let raw: Vec<RawDescriptor> = descs
            .iter()
            .map(|&(a, l, f)| RawDescriptor::from(SplitDescriptor::new(a, l, f, 0)))
            .collect();
        let mock = MockSplitQueue::new(&mem, 16);
        let chain = mock.build_desc_chain(&raw).unwrap();
        let mut out = Vec::new();
        let r = parse_tx(&mem, chain, 3, &mut out);
        (r, out)
    }

    fn tx_hdr(len: u32) -> Header {
        Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 1,
            dst_port: 2,
            len,
            kind: packet::TYPE_STREAM,
            op: packet::op::RW,
            ..Header::default()
        }
    }

    #[test]
    fn tx_chains_are_validated() {
        // Header split over two descriptors, payload in a third, a writable one ignored.
        let (r, p) = parse(
            &[
                (0x1000, 20, 0),
                (0x2000, 24, 0),
                (0x3000, 5, 0),
                (0x4000, 64, 2),
            ],
            &tx_hdr(5),
            b"hello",
        );
        assert!(matches!(r, TxPacket::Ok(h) if h.len == 5));
        assert_eq!(p, b"hello");
        // Header shorter than 44 bytes.
        let (r, _) = parse(&[(0x1000, 40, 0)], &tx_hdr(0), b"");
        assert!(matches!(r, TxPacket::Malformed));
        // Only writable descriptors.
        let (r, _) = parse(&[(0x1000, 64, 2)], &tx_hdr(0), b"");
        assert!(matches!(r, TxPacket::Malformed));
        // Outside guest memory.
        let (r, _) = parse(&[(0xffff_f000, 64, 0)], &tx_hdr(0), b"");
        assert!(matches!(r, TxPacket::Malformed));
        // Wrong CIDs.
        let mut h = tx_hdr(0);
        h.src_cid = 4;
        assert!(matches!(
            parse(&[(0x1000, 44, 0)], &h, b"").0,
            TxPacket::BadAddress
        ));
        let mut h = tx_hdr(0);
        h.dst_cid = 3;
        assert!(matches!(
            parse(&[(0x1000, 44, 0)], &h, b"").0,
            TxPacket::BadAddress
        ));
        // Length beyond the chain, beyond the largest packet.
        let (r, p) = parse(&[(0x1000, 44, 0), (0x2000, 5, 0)], &tx_hdr(6), b"hello");
        assert!(matches!(r, TxPacket::BadPayload(_)));
        assert!(p.is_empty());
        let big = MAX_PKT_PAYLOAD as u32 + 1;
        let (r, _) = parse(&[(0x1000, 44, 0), (0x2_0000, big, 0)], &tx_hdr(big), b"");
        assert!(matches!(r, TxPacket::BadPayload(_)));
    }

    #[test]
    fn restore_validates_state() {
        let d = tempfile::tempdir().unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let irq = Arc::new(Interrupt::new(EventTrigger::new().unwrap()));
        let inactive = VsockState {
            guest_cid: 3,
            acked_features: 0,
            activated: false,
            queues: vec![],
            connections: None,
        };
        let dev = Vsock::restore((cfg(&d, 4), None), &inactive).unwrap();
        assert_eq!(dev.config().guest_cid, 4);
        assert!(!dev.is_activated());
        drop(dev);
        let mut bad = inactive.clone();
        bad.acked_features = 1 << 5;
        assert!(matches!(
            Vsock::restore((cfg(&d, 3), None), &bad),
            Err(VsockError::State(_))
        ));
        let mut bad = inactive.clone();
        bad.activated = true;
        assert!(matches!(
            Vsock::restore((cfg(&d, 3), None), &bad),
            Err(VsockError::State(_))
        ));
        let q = QueueSnapshot {
            max_size: 256,
            size: 256,
            ready: true,
            desc_table: 0x1000,
            avail_ring: 0x2000,
            used_ring: 0x3000,
            ..QueueSnapshot::default()
        };
        bad.queues = vec![q; 2];
        let args = (cfg(&d, 3), Some((mem.clone(), irq.clone())));
        assert!(matches!(
            Vsock::restore(args, &bad),
            Err(VsockError::State(_))
        ));
        let mut outside = q;
        outside.used_ring = 0xffff_0000;
        bad.queues = vec![q, q, outside];
        let args = (cfg(&d, 3), Some((mem.clone(), irq.clone())));
        assert!(matches!(
            Vsock::restore(args, &bad),
            Err(VsockError::Queue { index: 2, .. })
        ));
        bad.queues = vec![q, QueueSnapshot { ready: false, ..q }, q];
        let args = (cfg(&d, 3), Some((mem, irq)));
        assert!(matches!(
            Vsock::restore(args, &bad),
            Err(VsockError::Queue { index: 1, .. })
        ));
    }
}

//! The guest half of volumes: a small FUSE filesystem whose files live on the host.
//!
//! `ember-agent volume-mount PORT NAME:PATH[:ro]...` (run by the runtime through `exec` when a
//! sandbox with volume mounts is created) connects to the host once per mount (vsock CID 2,
//! `PORT`), says hello with the volume's name, opens `/dev/fuse`, mounts it at `PATH`, and then
//! forks one daemon (its own session, stdio on `/dev/null`) that serves every mount, a thread
//! each; the command exits 0 once every mount is in place, or non-zero naming what failed.
//!
//! The daemon translates FUSE requests into the path-based requests of [`crate::volume_wire`]:
//! node ids are this process's own (a table of node id → path), the host knows only paths and
//! open write handles. When the connection breaks (the sandbox was restored from a snapshot, or
//! forked: guest-made vsock connections are not kept), the daemon connects again and repeats
//! the request; write handles the host lost then fail with EIO. No symlinks, hard links, special
//! files or extended attributes: a volume holds directories and regular files.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use serde::de::DeserializeOwned;

use crate::volume_wire::{self as wire, Attr, Entry, Opened, Reply, Request, VolumeState};

/// One mount: volume `name` at guest directory `path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountSpec {
    pub name: String,
    pub path: String,
    pub read_only: bool,
}

/// Parses `NAME:PATH[:ro]`.
pub fn parse_spec(s: &str) -> Result<MountSpec, String> {
    let mut it = s.splitn(3, ':');
    let name = it.next().unwrap_or_default();
    let path = it
        .next()
        .ok_or_else(|| format!("{s:?}: expected NAME:PATH[:ro]"))?;
    let read_only = match it.next() {
        None | Some("rw") => false,
        Some("ro") => true,
        Some(o) => return Err(format!("{s:?}: unknown mount option {o:?} (ro or rw)")),
    };
    if name.is_empty() || !path.starts_with('/') {
        return Err(format!("{s:?}: expected NAME:/absolute/path[:ro]"));
    }
    Ok(MountSpec {
        name: name.to_string(),
        path: path.to_string(),
        read_only,
    })
}

/// `volume-mount`: mounts every spec, forks the serving daemon, returns the exit status.
pub fn mount_command(port: u32, specs: &[MountSpec], err: &mut dyn Write) -> i32 {
    let mut ready = Vec::new();
    for spec in specs {
        match prepare(port, spec) {
            Ok(m) => ready.push(m),
            Err(e) => {
                let _ = writeln!(err, "error: volume {} at {}: {e}", spec.name, spec.path);
                return 1;
            }
        }
    }
    // SAFETY: fork in a single-threaded process (this CLI starts no threads before it).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        let _ = writeln!(err, "error: fork: {}", io::Error::last_os_error());
        return 1;
    }
    if pid > 0 {
        return 0;
    }
    // The daemon: its own session, stdio on /dev/null (the exec that started us ends now).
    // SAFETY: setsid has no memory-safety preconditions.
    unsafe { libc::setsid() };
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        for fd in 0..3 {
            // SAFETY: dup2 onto the standard descriptors, which this process owns.
            unsafe { libc::dup2(null.as_raw_fd(), fd) };
        }
    }
    let threads: Vec<_> = ready
        .into_iter()
        .map(|m| std::thread::spawn(move || serve(m)))
        .collect();
    for t in threads {
        let _ = t.join();
    }
    // SAFETY: _exit ends the daemon without running the parent's atexit handlers twice.
    unsafe { libc::_exit(0) }
}

/// A mount made, not yet served.
struct Ready {
    fuse: File,
    host: Host,
}

fn prepare(port: u32, spec: &MountSpec) -> Result<Ready, String> {
    let mut host = Host {
        port,
        volume: spec.name.clone(),
        conn: None,
    };
    let state: VolumeState = host.hello().map_err(|e| format!("host refused: {e}"))?;
    std::fs::create_dir_all(&spec.path).map_err(|e| format!("mkdir: {e}"))?;
    let fuse = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map_err(|e| format!("/dev/fuse: {e} (a guest kernel without CONFIG_FUSE_FS?)"))?;
    let opts = format!(
        "fd={},rootmode=40000,user_id=0,group_id=0,allow_other,max_read={}",
        fuse.as_raw_fd(),
        MAX_WRITE
    );
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
    if spec.read_only || state.read_only {
        flags |= libc::MS_RDONLY;
    }
    let src = CString::new("ember-volume").unwrap_or_default();
    let fstype = CString::new("fuse").unwrap_or_default();
    let target = CString::new(spec.path.as_str()).map_err(|_| "path has a NUL byte")?;
    let data = CString::new(opts).unwrap_or_default();
    // SAFETY: every pointer is a valid NUL-terminated string that outlives the call.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(format!("mount: {}", io::Error::last_os_error()));
    }
    Ok(Ready { fuse, host })
}

// ------------------------------------------------------------------ host link ---

struct Host {
    port: u32,
    volume: String,
    conn: Option<File>,
}

/// A request's failure: an errno for the FUSE reply.
type Errno = i32;

/// Why a hello failed: the link (retry), or the host's refusal (an errno).
enum HelloError {
    Link(String),
    Refused(i32),
}

impl Host {
    fn connect(port: u32) -> io::Result<File> {
        // SAFETY: plain socket(2) call; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor this function owns.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_vm is plain old data; all zeroes is valid.
        let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
        addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
        addr.svm_port = port;
        addr.svm_cid = libc::VMADDR_CID_HOST;
        // SAFETY: `addr` is an initialised sockaddr_vm that outlives the call.
        let r = unsafe {
            libc::connect(
                owned.as_raw_fd(),
                (&addr as *const libc::sockaddr_vm).cast(),
                std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(File::from(owned))
    }

    fn hello(&mut self) -> Result<VolumeState, String> {
        self.try_hello().map_err(|e| match e {
            HelloError::Link(m) => m,
            HelloError::Refused(errno) => {
                format!("{}", io::Error::from_raw_os_error(errno))
            }
        })
    }

    fn try_hello(&mut self) -> Result<VolumeState, HelloError> {
        let mut c =
            Self::connect(self.port).map_err(|e| HelloError::Link(format!("connect: {e}")))?;
        let req = Request::Hello {
            volume: self.volume.clone(),
        };
        let (rep, _) =
            exchange(&mut c, &req, &[]).map_err(|e| HelloError::Link(format!("hello: {e}")))?;
        if rep.errno != 0 {
            return Err(HelloError::Refused(rep.errno));
        }
        let st = serde_json::from_value(rep.body)
            .map_err(|e| HelloError::Link(format!("hello: {e}")))?;
        self.conn = Some(c);
        Ok(st)
    }

    /// Sends `req`, reconnecting (with a back-off) when the link breaks — the host comes back
    /// after a restore. A host that answers but refuses the volume (it was deleted) fails the
    /// request with EIO instead.
    fn call(&mut self, req: &Request, data: &[u8]) -> Result<(serde_json::Value, Vec<u8>), Errno> {
        let mut delay = Duration::from_millis(5);
        loop {
            if self.conn.is_none() {
                match self.try_hello() {
                    Ok(_) => {}
                    Err(HelloError::Refused(_)) => return Err(libc::EIO),
                    Err(HelloError::Link(_)) => {
                        std::thread::sleep(delay);
                        delay = (delay * 2).min(Duration::from_millis(250));
                        continue;
                    }
                }
            }
            let Some(c) = self.conn.as_mut() else {
                continue;
            };
            match exchange(c, req, data) {
                Ok((rep, out)) if rep.errno == 0 => return Ok((rep.body, out)),
                Ok((rep, _)) => return Err(rep.errno),
                Err(_) => self.conn = None,
            }
        }
    }

    fn call_as<T: DeserializeOwned>(&mut self, req: &Request) -> Result<T, Errno> {
        let (body, _) = self.call(req, &[])?;
        serde_json::from_value(body).map_err(|_| libc::EIO)
    }
}

fn exchange(c: &mut File, req: &Request, data: &[u8]) -> io::Result<(Reply, Vec<u8>)> {
    let header = serde_json::to_vec(req).map_err(io::Error::other)?;
    wire::write_frame(c, &header, data)?;
    let (h, d) = wire::read_frame(c)?;
    let rep: Reply = serde_json::from_slice(&h).map_err(io::Error::other)?;
    Ok((rep, d))
}

// ------------------------------------------------------------------ FUSE ABI ---

const FUSE_LOOKUP: u32 = 1;
const FUSE_FORGET: u32 = 2;
const FUSE_GETATTR: u32 = 3;
const FUSE_SETATTR: u32 = 4;
const FUSE_MKDIR: u32 = 9;
const FUSE_UNLINK: u32 = 10;
const FUSE_RMDIR: u32 = 11;
const FUSE_RENAME: u32 = 12;
const FUSE_OPEN: u32 = 14;
const FUSE_READ: u32 = 15;
const FUSE_WRITE: u32 = 16;
const FUSE_STATFS: u32 = 17;
const FUSE_RELEASE: u32 = 18;
const FUSE_FSYNC: u32 = 20;
const FUSE_FLUSH: u32 = 25;
const FUSE_INIT: u32 = 26;
const FUSE_OPENDIR: u32 = 27;
const FUSE_READDIR: u32 = 28;
const FUSE_RELEASEDIR: u32 = 29;
const FUSE_FSYNCDIR: u32 = 30;
const FUSE_INTERRUPT: u32 = 36;
const FUSE_CREATE: u32 = 35;
const FUSE_DESTROY: u32 = 38;
const FUSE_BATCH_FORGET: u32 = 42;
const FUSE_RENAME2: u32 = 45;

const FUSE_ATOMIC_O_TRUNC: u32 = 1 << 3;
const FUSE_BIG_WRITES: u32 = 1 << 5;
const FUSE_MAX_PAGES: u32 = 1 << 22;

const FATTR_SIZE: u32 = 1 << 3;
const FATTR_FH: u32 = 1 << 6;
const FUSE_GETATTR_FH: u32 = 1;

/// Largest write (and read) the kernel sends: 256 pages.
const MAX_WRITE: u32 = 1 << 20;
const IN_HEADER: usize = 40;
/// Attribute and entry cache time: short, so other sandboxes' changes show within a second.
const TTL_SECS: u64 = 1;

fn u32_at(b: &[u8], off: usize) -> u32 {
    b.get(off..off + 4)
        .and_then(|s| s.try_into().ok())
        .map(u32::from_le_bytes)
        .unwrap_or(0)
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    b.get(off..off + 8)
        .and_then(|s| s.try_into().ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0)
}

/// The NUL-terminated names at the start of `b` (up to two).
fn names(b: &[u8]) -> (Option<&str>, Option<&str>) {
    let mut it = b.split(|c| *c == 0);
    let a = it.next().and_then(|s| std::str::from_utf8(s).ok());
    let b = it.next().and_then(|s| std::str::from_utf8(s).ok());
    (a, b)
}

fn attr_bytes(out: &mut Vec<u8>, ino: u64, a: &Attr) {
    let secs = a.mtime_ns.div_euclid(1_000_000_000) as u64;
    let nsec = a.mtime_ns.rem_euclid(1_000_000_000) as u32;
    let kind = if a.dir { libc::S_IFDIR } else { libc::S_IFREG };
    out.extend_from_slice(&ino.to_le_bytes());
    out.extend_from_slice(&a.size.to_le_bytes());
    out.extend_from_slice(&a.size.div_ceil(512).to_le_bytes());
    for _ in 0..3 {
        out.extend_from_slice(&secs.to_le_bytes());
    }
    for _ in 0..3 {
        out.extend_from_slice(&nsec.to_le_bytes());
    }
    out.extend_from_slice(&(kind | (a.mode & 0o7777)).to_le_bytes());
    out.extend_from_slice(&(if a.dir { 2u32 } else { 1 }).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes()); // uid
    out.extend_from_slice(&0u32.to_le_bytes()); // gid
    out.extend_from_slice(&0u32.to_le_bytes()); // rdev
    out.extend_from_slice(&4096u32.to_le_bytes()); // blksize
    out.extend_from_slice(&0u32.to_le_bytes()); // flags
}

fn entry_bytes(out: &mut Vec<u8>, nodeid: u64, a: &Attr) {
    out.extend_from_slice(&nodeid.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes()); // generation
    out.extend_from_slice(&TTL_SECS.to_le_bytes());
    out.extend_from_slice(&TTL_SECS.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    attr_bytes(out, nodeid, a);
}

fn attr_out(nodeid: u64, a: &Attr) -> Vec<u8> {
    let mut out = Vec::with_capacity(104);
    out.extend_from_slice(&TTL_SECS.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    attr_bytes(&mut out, nodeid, a);
    out
}

// ------------------------------------------------------------------ nodes ---

/// Node id → path (relative to the volume root; `""` is the root, node 1).
#[derive(Debug)]
struct Nodes {
    by_id: HashMap<u64, (String, u64)>,
    by_path: HashMap<String, u64>,
    next: u64,
}

impl Nodes {
    fn new() -> Nodes {
        let mut n = Nodes {
            by_id: HashMap::new(),
            by_path: HashMap::new(),
            next: 2,
        };
        n.by_id.insert(1, (String::new(), 1));
        n.by_path.insert(String::new(), 1);
        n
    }

    fn path(&self, id: u64) -> Option<&str> {
        self.by_id.get(&id).map(|(p, _)| p.as_str())
    }

    fn child(&self, parent: u64, name: &str) -> Result<String, Errno> {
        if name.is_empty() || name == "." || name == ".." || name.contains('/') {
            return Err(libc::EINVAL);
        }
        let p = self.path(parent).ok_or(libc::ESTALE)?;
        Ok(if p.is_empty() {
            name.to_string()
        } else {
            format!("{p}/{name}")
        })
    }

    /// The node of `path`, one more lookup counted.
    fn lookup(&mut self, path: &str) -> u64 {
        if let Some(id) = self.by_path.get(path) {
            if let Some(e) = self.by_id.get_mut(id) {
                e.1 += 1;
            }
            return *id;
        }
        let id = self.next;
        self.next += 1;
        self.by_id.insert(id, (path.to_string(), 1));
        self.by_path.insert(path.to_string(), id);
        id
    }

    fn forget(&mut self, id: u64, n: u64) {
        if id == 1 {
            return;
        }
        let gone = match self.by_id.get_mut(&id) {
            Some(e) => {
                e.1 = e.1.saturating_sub(n);
                e.1 == 0
            }
            None => false,
        };
        if gone {
            if let Some((p, _)) = self.by_id.remove(&id) {
                if self.by_path.get(&p) == Some(&id) {
                    self.by_path.remove(&p);
                }
            }
        }
    }

    /// `path` no longer names its node (removed, or replaced by a rename).
    fn unlink(&mut self, path: &str) {
        if let Some(id) = self.by_path.remove(path) {
            if let Some(e) = self.by_id.get_mut(&id) {
                e.0 = format!("\0gone/{id}");
            }
        }
    }

    /// Moves `from` (and everything under it) to `to`.
    fn rename(&mut self, from: &str, to: &str) {
        self.unlink(to);
        let prefix = format!("{from}/");
        let moved: Vec<(String, u64)> = self
            .by_path
            .iter()
            .filter(|(p, _)| p.as_str() == from || p.starts_with(&prefix))
            .map(|(p, id)| (p.clone(), *id))
            .collect();
        for (p, id) in moved {
            self.by_path.remove(&p);
            let np = format!("{to}{}", &p[from.len()..]);
            if let Some(e) = self.by_id.get_mut(&id) {
                e.0 = np.clone();
            }
            self.by_path.insert(np, id);
        }
    }
}

// ------------------------------------------------------------------ the loop ---

struct Fs {
    host: Host,
    nodes: Nodes,
    /// Open directory listings, by handle.
    dirs: HashMap<u64, Vec<(u64, String, bool)>>,
    next_dir: u64,
    /// Open write handles by path (getattr of a file being written asks its handle).
    writers: HashMap<String, Vec<u64>>,
}

enum Out {
    Data(Vec<u8>),
    Err(Errno),
    None,
}

fn serve(m: Ready) {
    let Ready { mut fuse, host } = m;
    let mut fs = Fs {
        host,
        nodes: Nodes::new(),
        dirs: HashMap::new(),
        next_dir: 1,
        writers: HashMap::new(),
    };
    let mut buf = vec![0u8; MAX_WRITE as usize + 64 * 1024];
    loop {
        let n = match fuse.read(&mut buf) {
            Ok(n) => n,
            Err(e) => match e.raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::ENOENT) => continue,
                _ => return, // ENODEV: unmounted
            },
        };
        let req = &buf[..n];
        if req.len() < IN_HEADER {
            continue;
        }
        let opcode = u32_at(req, 4);
        let unique = u64_at(req, 8);
        let nodeid = u64_at(req, 16);
        let body = &req[IN_HEADER..];
        if opcode == FUSE_DESTROY {
            let _ = reply(&mut fuse, unique, Out::Data(Vec::new()));
            return;
        }
        let out = fs.handle(opcode, nodeid, body);
        if let Out::None = out {
            continue;
        }
        if reply(&mut fuse, unique, out).is_err() {
            // ENOENT: the request was interrupted; anything else: keep going.
            continue;
        }
    }
}

fn reply(fuse: &mut File, unique: u64, out: Out) -> io::Result<()> {
    let (err, data) = match out {
        Out::Data(d) => (0i32, d),
        Out::Err(e) => (-e, Vec::new()),
        Out::None => return Ok(()),
    };
    let mut b = Vec::with_capacity(16 + data.len());
    b.extend_from_slice(&((16 + data.len()) as u32).to_le_bytes());
    b.extend_from_slice(&err.to_le_bytes());
    b.extend_from_slice(&unique.to_le_bytes());
    b.extend_from_slice(&data);
    fuse.write_all(&b)
}

impl Fs {
    fn handle(&mut self, opcode: u32, nodeid: u64, body: &[u8]) -> Out {
        let r = match opcode {
            FUSE_INIT => Ok(init_reply(body)),
            FUSE_FORGET => {
                self.nodes.forget(nodeid, u64_at(body, 0));
                return Out::None;
            }
            FUSE_BATCH_FORGET => {
                let count = u32_at(body, 0) as usize;
                for i in 0..count {
                    let off = 8 + i * 16;
                    self.nodes.forget(u64_at(body, off), u64_at(body, off + 8));
                }
                return Out::None;
            }
            FUSE_INTERRUPT => return Out::None,
            FUSE_LOOKUP => self.lookup(nodeid, body),
            FUSE_GETATTR => self.getattr(nodeid, body),
            FUSE_SETATTR => self.setattr(nodeid, body),
            FUSE_OPEN => self.open(nodeid, body),
            FUSE_CREATE => self.create(nodeid, body),
            FUSE_READ => self.read(nodeid, body),
            FUSE_WRITE => self.write(body),
            FUSE_FLUSH | FUSE_FSYNC => self.flush(body),
            FUSE_RELEASE => self.release(nodeid, body),
            FUSE_OPENDIR => self.opendir(nodeid),
            FUSE_READDIR => self.readdir(body),
            FUSE_RELEASEDIR => {
                self.dirs.remove(&u64_at(body, 0));
                Ok(Vec::new())
            }
            FUSE_FSYNCDIR => Ok(Vec::new()),
            FUSE_MKDIR => self.mkdir(nodeid, body),
            FUSE_UNLINK | FUSE_RMDIR => self.remove(opcode, nodeid, body),
            FUSE_RENAME => self.rename(nodeid, u64_at(body, 0), 0, &body[8.min(body.len())..]),
            FUSE_RENAME2 => self.rename(
                nodeid,
                u64_at(body, 0),
                u32_at(body, 8),
                &body[16.min(body.len())..],
            ),
            FUSE_STATFS => self.statfs(),
            _ => Err(libc::ENOSYS),
        };
        match r {
            Ok(d) => Out::Data(d),
            Err(e) => Out::Err(e),
        }
    }

    fn path(&self, nodeid: u64) -> Result<String, Errno> {
        let p = self.nodes.path(nodeid).ok_or(libc::ESTALE)?;
        if p.starts_with('\0') {
            return Err(libc::ENOENT);
        }
        Ok(p.to_string())
    }

    fn stat(&mut self, path: &str, fh: Option<u64>) -> Result<Attr, Errno> {
        let fh = fh.or_else(|| self.writers.get(path).and_then(|v| v.first().copied()));
        self.host.call_as(&Request::Stat {
            path: path.to_string(),
            fh,
        })
    }

    fn entry(&mut self, path: &str) -> Result<Vec<u8>, Errno> {
        let a = self.stat(path, None)?;
        let id = self.nodes.lookup(path);
        let mut out = Vec::with_capacity(128);
        entry_bytes(&mut out, id, &a);
        Ok(out)
    }

    fn lookup(&mut self, parent: u64, body: &[u8]) -> Result<Vec<u8>, Errno> {
        let name = names(body).0.ok_or(libc::EINVAL)?;
        let path = self.nodes.child(parent, name)?;
        self.entry(&path)
    }

    fn getattr(&mut self, nodeid: u64, body: &[u8]) -> Result<Vec<u8>, Errno> {
        let fh = (u32_at(body, 0) & FUSE_GETATTR_FH != 0)
            .then(|| u64_at(body, 8))
            .filter(|f| *f != 0);
        let path = self.path(nodeid)?;
        let a = self.stat(&path, fh)?;
        Ok(attr_out(nodeid, &a))
    }

    fn setattr(&mut self, nodeid: u64, body: &[u8]) -> Result<Vec<u8>, Errno> {
        let valid = u32_at(body, 0);
        let path = self.path(nodeid)?;
        if valid & FATTR_SIZE != 0 {
            let fh = (valid & FATTR_FH != 0)
                .then(|| u64_at(body, 8))
                .filter(|f| *f != 0)
                .or_else(|| self.writers.get(&path).and_then(|v| v.first().copied()));
            let a: Attr = self.host.call_as(&Request::SetSize {
                path: path.clone(),
                fh,
                size: u64_at(body, 16),
            })?;
            return Ok(attr_out(nodeid, &a));
        }
        // Modes, owners and times are not kept: answer what is.
        let a = self.stat(&path, None)?;
        Ok(attr_out(nodeid, &a))
    }

    fn open_reply(fh: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(16);
        out.extend_from_slice(&fh.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out
    }

    fn open(&mut self, nodeid: u64, body: &[u8]) -> Result<Vec<u8>, Errno> {
        let flags = u32_at(body, 0) as i32;
        let path = self.path(nodeid)?;
        if flags & libc::O_ACCMODE == libc::O_RDONLY {
            return Ok(Self::open_reply(0));
        }
        let o: Opened = self.host.call_as(&Request::Open {
            path: path.clone(),
            create: false,
            excl: false,
            trunc: flags & libc::O_TRUNC != 0,
            mode: 0o644,
        })?;
        self.writers.entry(path).or_default().push(o.fh);
        Ok(Self::open_reply(o.fh))
    }

    fn create(&mut self, parent: u64, body: &[u8]) -> Result<Vec<u8>, Errno> {
        let flags = u32_at(body, 0) as i32;
        let mode = u32_at(body, 4);
        let name = names(&body[16.min(body.len())..]).0.ok_or(libc::EINVAL)?;
        let path = self.nodes.child(parent, name)?;
        let o: Opened = self.host.call_as(&Request::Open {
            path: path.clone(),
            create: true,
            excl: flags & libc::O_EXCL != 0,
            trunc: true,
            mode: mode & 0o777,
        })?;
        self.writers.entry(path.clone()).or_default().push(o.fh);
        let id = self.nodes.lookup(&path);
        let mut out = Vec::with_capacity(144);
        entry_bytes(&mut out, id, &o.attr);
        out.extend_from_slice(&Self::open_reply(o.fh));
        Ok(out)
    }

    fn read(&mut self, nodeid: u64, body: &[u8]) -> Result<Vec<u8>, Errno> {
        let fh = u64_at(body, 0);
        let path = self.path(nodeid)?;
        let (_, data) = self.host.call(
            &Request::Read {
                path,
                fh: (fh != 0).then_some(fh),
                off: u64_at(body, 8),
                len: u32_at(body, 16).min(MAX_WRITE),
            },
            &[],
        )?;
        Ok(data)
    }

    fn write(&mut self, body: &[u8]) -> Result<Vec<u8>, Errno> {
        let fh = u64_at(body, 0);
        let off = u64_at(body, 8);
        let size = u32_at(body, 16) as usize;
        let data = body.get(40..40 + size).ok_or(libc::EINVAL)?;
        if fh == 0 {
            return Err(libc::EBADF);
        }
        self.host.call(&Request::Write { fh, off }, data)?;
        let mut out = Vec::with_capacity(8);
        out.extend_from_slice(&(size as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        Ok(out)
    }

    fn flush(&mut self, body: &[u8]) -> Result<Vec<u8>, Errno> {
        let fh = u64_at(body, 0);
        if fh != 0 {
            self.host.call(&Request::Flush { fh }, &[])?;
        }
        Ok(Vec::new())
    }

    fn release(&mut self, nodeid: u64, body: &[u8]) -> Result<Vec<u8>, Errno> {
        let fh = u64_at(body, 0);
        if fh == 0 {
            return Ok(Vec::new());
        }
        self.writers.retain(|_, v| {
            v.retain(|f| *f != fh);
            !v.is_empty()
        });
        let _ = nodeid;
        self.host.call(&Request::Release { fh }, &[])?;
        Ok(Vec::new())
    }

    fn opendir(&mut self, nodeid: u64) -> Result<Vec<u8>, Errno> {
        let path = self.path(nodeid)?;
        let (_, data) = self.host.call(&Request::List { path: path.clone() }, &[])?;
        let entries: Vec<Entry> = serde_json::from_slice(&data).map_err(|_| libc::EIO)?;
        let mut list = vec![(nodeid, ".".to_string(), true), (1, "..".to_string(), true)];
        for e in entries {
            let child = if path.is_empty() {
                e.name.clone()
            } else {
                format!("{path}/{}", e.name)
            };
            let ino = self
                .nodes
                .by_path
                .get(&child)
                .copied()
                .unwrap_or_else(|| hash_ino(&child));
            list.push((ino, e.name, e.dir));
        }
        let h = self.next_dir;
        self.next_dir += 1;
        self.dirs.insert(h, list);
        Ok(Self::open_reply(h))
    }

    fn readdir(&mut self, body: &[u8]) -> Result<Vec<u8>, Errno> {
        let fh = u64_at(body, 0);
        let off = u64_at(body, 8) as usize;
        let size = u32_at(body, 16) as usize;
        let list = self.dirs.get(&fh).ok_or(libc::EBADF)?;
        let mut out = Vec::new();
        for (i, (ino, name, dir)) in list.iter().enumerate().skip(off) {
            let entlen = 24 + name.len();
            let padded = entlen.div_ceil(8) * 8;
            if out.len() + padded > size {
                break;
            }
            out.extend_from_slice(&ino.to_le_bytes());
            out.extend_from_slice(&((i + 1) as u64).to_le_bytes());
            out.extend_from_slice(&(name.len() as u32).to_le_bytes());
            let t = if *dir { libc::DT_DIR } else { libc::DT_REG } as u32;
            out.extend_from_slice(&t.to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.resize(out.len() + (padded - entlen), 0);
        }
        Ok(out)
    }

    fn mkdir(&mut self, parent: u64, body: &[u8]) -> Result<Vec<u8>, Errno> {
        let mode = u32_at(body, 0);
        let name = names(&body[8.min(body.len())..]).0.ok_or(libc::EINVAL)?;
        let path = self.nodes.child(parent, name)?;
        self.host.call(
            &Request::Mkdir {
                path: path.clone(),
                mode: mode & 0o777,
            },
            &[],
        )?;
        self.entry(&path)
    }

    fn remove(&mut self, opcode: u32, parent: u64, body: &[u8]) -> Result<Vec<u8>, Errno> {
        let name = names(body).0.ok_or(libc::EINVAL)?;
        let path = self.nodes.child(parent, name)?;
        let req = if opcode == FUSE_UNLINK {
            Request::Unlink { path: path.clone() }
        } else {
            Request::Rmdir { path: path.clone() }
        };
        self.host.call(&req, &[])?;
        self.nodes.unlink(&path);
        Ok(Vec::new())
    }

    fn rename(
        &mut self,
        parent: u64,
        newdir: u64,
        flags: u32,
        rest: &[u8],
    ) -> Result<Vec<u8>, Errno> {
        const RENAME_NOREPLACE: u32 = 1;
        if flags & !RENAME_NOREPLACE != 0 {
            return Err(libc::EINVAL);
        }
        let (a, b) = names(rest);
        let from = self.nodes.child(parent, a.ok_or(libc::EINVAL)?)?;
        let to = self.nodes.child(newdir, b.ok_or(libc::EINVAL)?)?;
        self.host.call(
            &Request::Rename {
                from: from.clone(),
                to: to.clone(),
                noreplace: flags & RENAME_NOREPLACE != 0,
            },
            &[],
        )?;
        self.nodes.rename(&from, &to);
        if let Some(v) = self.writers.remove(&from) {
            self.writers.insert(to, v);
        }
        Ok(Vec::new())
    }

    fn statfs(&mut self) -> Result<Vec<u8>, Errno> {
        let s: VolumeState = self.host.call_as(&Request::Statfs)?;
        let bs = 4096u64;
        let blocks = s.cap_bytes / bs;
        let free = s.cap_bytes.saturating_sub(s.used_bytes) / bs;
        let mut out = Vec::with_capacity(80);
        for v in [blocks, free, free, 1 << 20, 1 << 20] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(bs as u32).to_le_bytes()); // bsize
        out.extend_from_slice(&255u32.to_le_bytes()); // namelen
        out.extend_from_slice(&(bs as u32).to_le_bytes()); // frsize
        out.resize(80, 0);
        Ok(out)
    }
}

fn init_reply(body: &[u8]) -> Vec<u8> {
    let flags = u32_at(body, 12) & (FUSE_ATOMIC_O_TRUNC | FUSE_BIG_WRITES | FUSE_MAX_PAGES);
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&7u32.to_le_bytes()); // major
    out.extend_from_slice(&31u32.to_le_bytes()); // minor
    out.extend_from_slice(&(128 * 1024u32).to_le_bytes()); // max_readahead
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&16u16.to_le_bytes()); // max_background
    out.extend_from_slice(&12u16.to_le_bytes()); // congestion_threshold
    out.extend_from_slice(&MAX_WRITE.to_le_bytes());
    out.extend_from_slice(&1u32.to_le_bytes()); // time_gran
    out.extend_from_slice(&((MAX_WRITE / 4096) as u16).to_le_bytes()); // max_pages
    out.extend_from_slice(&0u16.to_le_bytes()); // map_alignment
    out.resize(64, 0);
    out
}

/// An inode number for a listed entry not (yet) looked up: stable per path, never 1.
fn hash_ino(path: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in path.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h | (1 << 63)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse() {
        assert_eq!(
            parse_spec("data:/mnt/data:ro").unwrap(),
            MountSpec {
                name: "data".into(),
                path: "/mnt/data".into(),
                read_only: true
            }
        );
        assert!(!parse_spec("d:/x").unwrap().read_only);
        assert!(parse_spec("d:relative").is_err());
        assert!(parse_spec(":/x").is_err());
        assert!(parse_spec("d:/x:rx").is_err());
    }

    #[test]
    fn nodes_follow_renames_and_removals() {
        let mut n = Nodes::new();
        let d = n.lookup("a");
        let f = n.lookup("a/f");
        n.rename("a", "b");
        assert_eq!(n.path(d), Some("b"));
        assert_eq!(n.path(f), Some("b/f"));
        n.unlink("b/f");
        assert!(n.path(f).unwrap().starts_with('\0'));
        n.forget(d, 1);
        assert_eq!(n.path(d), None);
        assert_eq!(n.child(1, "x").unwrap(), "x");
        assert!(n.child(1, "..").is_err());
    }

    #[test]
    fn sizes_of_the_abi_structs() {
        let a = Attr {
            dir: false,
            size: 1,
            mode: 0o644,
            mtime_ns: 5,
        };
        assert_eq!(attr_out(2, &a).len(), 104);
        let mut e = Vec::new();
        entry_bytes(&mut e, 2, &a);
        assert_eq!(e.len(), 128);
        assert_eq!(init_reply(&[0; 16]).len(), 64);
    }
}

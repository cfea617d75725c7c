//! The host's volume file server: one listener per sandbox with mounts, at its VMM's
//! `<vsock uds>_1030` (where the VMM sends the guest's connections to host port 1030), and a
//! thread per connection speaking `ember_agent::volume_wire`.
//!
//! It runs in the runtime (the server process), never in the VMM: a VMM killed mid-write only
//! closes the connection, and the connection's unpublished writes are discarded. The guest is
//! hostile: every path is checked and resolved beneath the volume (`fsops.rs`), only the
//! sandbox's own mounts answer `hello`, a read-only mount refuses every change, a connection
//! holds at most [`MAX_HANDLES`] write handles, and nothing a guest sends is logged above
//! `debug`.

use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ember_agent::volume_wire::{self as wire, Opened, Reply, Request, VolumeState};

use super::fsops::{Handle, Vol};
use super::{VolumeMount, Volumes};

/// Most open write handles per connection.
pub const MAX_HANDLES: usize = 256;

/// Listens for sandbox `id`'s guest at `<uds>_<port>`; returns the flag that stops it.
pub fn listen(vols: Arc<Volumes>, id: String, uds: &Path) -> io::Result<Arc<AtomicBool>> {
    let path = PathBuf::from(format!("{}_{}", uds.display(), wire::VOLUME_PORT));
    let _ = std::fs::remove_file(&path);
    let l = UnixListener::bind(&path)?;
    // The jailed VMM connects as the jail's account: give it the socket (its directory is the
    // jail's, closed to everyone else).
    if let Some(dir) = path.parent() {
        if let Ok(m) = std::fs::metadata(dir) {
            let _ = std::os::unix::fs::chown(&path, Some(m.uid()), Some(m.gid()));
        }
    }
    l.set_nonblocking(true)?;
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    std::thread::Builder::new()
        .name(format!("vol-{}", &id[..id.len().min(8)]))
        .spawn(move || accept_loop(vols, id, l, path, flag))?;
    Ok(stop)
}

fn accept_loop(
    vols: Arc<Volumes>,
    id: String,
    l: UnixListener,
    path: PathBuf,
    stop: Arc<AtomicBool>,
) {
    let ino = std::fs::metadata(&path).map(|m| m.ino()).ok();
    loop {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let mut pfd = libc::pollfd {
            fd: l.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, 500) };
        if n == 0 {
            // The jail went away (the VMM ended and its directory was removed): stop.
            if std::fs::metadata(&path).map(|m| m.ino()).ok() != ino {
                break;
            }
            continue;
        }
        match l.accept() {
            Ok((s, _)) => {
                let (vols, id) = (vols.clone(), id.clone());
                let _ = std::thread::Builder::new()
                    .name("vol-conn".into())
                    .spawn(move || {
                        let _ = s.set_nonblocking(false);
                        if let Err(e) = serve_conn(&vols, &id, s) {
                            tracing::debug!("sandbox {id}: volume connection: {e}");
                        }
                    });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => {
                tracing::debug!("sandbox {id}: volume listener: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
    if std::fs::metadata(&path).map(|m| m.ino()).ok() == ino {
        let _ = std::fs::remove_file(&path);
    }
}

struct Conn {
    vol: Arc<Vol>,
    read_only: bool,
    handles: HashMap<u64, Handle>,
    next: u64,
}

fn ok(body: serde_json::Value) -> Reply {
    Reply { errno: 0, body }
}

fn serve_conn(vols: &Volumes, id: &str, s: UnixStream) -> io::Result<()> {
    let mut r = BufReader::with_capacity(1 << 20, s.try_clone()?);
    let mut w = BufWriter::with_capacity(1 << 16, s);
    // The first request names the volume.
    let (h, _) = wire::read_frame(&mut r)?;
    let Ok(Request::Hello { volume }) = serde_json::from_slice::<Request>(&h) else {
        return Err(io::Error::other("the first request is not hello"));
    };
    let mount: Option<VolumeMount> = vols.mounts_of(id).into_iter().find(|m| m.name == volume);
    let vol = match mount.as_ref().map(|m| vols.vol(&m.name)) {
        Some(Ok(v)) => v,
        _ => {
            let rep = Reply {
                errno: libc::ENOENT,
                body: serde_json::Value::Null,
            };
            wire::write_frame(&mut w, &serde_json::to_vec(&rep)?, &[])?;
            return Ok(());
        }
    };
    let read_only = mount.is_some_and(|m| m.read_only);
    let mut c = Conn {
        vol,
        read_only,
        handles: HashMap::new(),
        next: 1,
    };
    let state = c.state();
    wire::write_frame(
        &mut w,
        &serde_json::to_vec(&ok(serde_json::to_value(state)?))?,
        &[],
    )?;
    loop {
        let (h, data) = match wire::read_frame(&mut r) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        let req: Request = serde_json::from_slice(&h).map_err(io::Error::other)?;
        let (rep, out) = match c.handle(req, &data) {
            Ok((body, out)) => (ok(body), out),
            Err(e) => (
                Reply {
                    errno: e.raw_os_error().unwrap_or(libc::EIO),
                    body: serde_json::Value::Null,
                },
                Vec::new(),
            ),
        };
        wire::write_frame(&mut w, &serde_json::to_vec(&rep)?, &out)?;
    }
    // Dropping `c` discards every unpublished write of this connection.
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

fn json<T: serde::Serialize>(v: T) -> io::Result<serde_json::Value> {
    serde_json::to_value(v).map_err(io::Error::other)
}

impl Conn {
    fn state(&self) -> VolumeState {
        VolumeState {
            read_only: self.read_only,
            cap_bytes: self.vol.cap_bytes,
            used_bytes: self.vol.used(),
        }
    }

    fn writable(&self) -> io::Result<()> {
        if self.read_only {
            Err(errno(libc::EROFS))
        } else {
            Ok(())
        }
    }

    fn handle_mut(&mut self, fh: u64) -> io::Result<&mut Handle> {
        self.handles.get_mut(&fh).ok_or_else(|| errno(libc::EBADF))
    }

    fn handle(&mut self, req: Request, data: &[u8]) -> io::Result<(serde_json::Value, Vec<u8>)> {
        let none = serde_json::Value::Null;
        Ok(match req {
            Request::Hello { .. } => (json(self.state())?, Vec::new()),
            Request::Statfs => (json(self.state())?, Vec::new()),
            Request::Stat { path, fh } => {
                let a = match fh.and_then(|f| self.handles.get(&f)) {
                    Some(h) => h.stat()?,
                    None => self.vol.stat(&path)?,
                };
                (json(a)?, Vec::new())
            }
            Request::List { path } => {
                let l = self.vol.list(&path)?;
                (none, serde_json::to_vec(&l).map_err(io::Error::other)?)
            }
            Request::Read { path, fh, off, len } => {
                let len = (len as usize).min(wire::MAX_DATA);
                let d = match fh.and_then(|f| self.handles.get(&f)) {
                    Some(h) => h.read_at(off, len)?,
                    None => self.vol.read_at(&path, off, len)?,
                };
                (none, d)
            }
            Request::Open {
                path,
                create,
                excl,
                trunc,
                mode,
            } => {
                self.writable()?;
                if self.handles.len() >= MAX_HANDLES {
                    return Err(errno(libc::EMFILE));
                }
                let h = self.vol.open_write(&path, create, excl, trunc, mode)?;
                let attr = h.stat()?;
                let fh = self.next;
                self.next += 1;
                self.handles.insert(fh, h);
                (json(Opened { fh, attr })?, Vec::new())
            }
            Request::Write { fh, off } => {
                self.writable()?;
                self.handle_mut(fh)?.write_at(off, data)?;
                (none, Vec::new())
            }
            Request::SetSize { path, fh, size } => {
                self.writable()?;
                let attr = match fh {
                    Some(fh) if self.handles.contains_key(&fh) => {
                        let h = self.handle_mut(fh)?;
                        h.set_size(size)?;
                        h.stat()?
                    }
                    _ => {
                        let mut h = self.vol.open_write(&path, false, false, false, 0o644)?;
                        h.set_size(size)?;
                        h.commit()?;
                        self.vol.stat(&path)?
                    }
                };
                (json(attr)?, Vec::new())
            }
            Request::Flush { fh } => {
                self.handle_mut(fh)?.commit()?;
                (none, Vec::new())
            }
            Request::Release { fh } => {
                if let Some(mut h) = self.handles.remove(&fh) {
                    h.commit()?;
                }
                (none, Vec::new())
            }
            Request::Mkdir { path, mode } => {
                self.writable()?;
                self.vol.mkdir(&path, mode)?;
                (none, Vec::new())
            }
            Request::Unlink { path } => {
                self.writable()?;
                self.vol.unlink(&path)?;
                (none, Vec::new())
            }
            Request::Rmdir { path } => {
                self.writable()?;
                self.vol.rmdir(&path)?;
                (none, Vec::new())
            }
            Request::Rename {
                from,
                to,
                noreplace,
            } => {
                self.writable()?;
                self.vol.rename(&from, &to, noreplace)?;
                (none, Vec::new())
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(s: &mut UnixStream, req: &Request, data: &[u8]) -> (Reply, Vec<u8>) {
        wire::write_frame(s, &serde_json::to_vec(req).unwrap(), data).unwrap();
        let (h, d) = wire::read_frame(s).unwrap();
        (serde_json::from_slice(&h).unwrap(), d)
    }

    #[test]
    fn a_guest_connection_reads_writes_and_is_confined() {
        let home = tempfile::tempdir().unwrap();
        let vols = Arc::new(Volumes::new(home.path()).unwrap());
        vols.create("v", Some(1000)).unwrap();
        vols.create("other", None).unwrap();
        vols.register("sb", &[VolumeMount::parse("v:/mnt/v").unwrap()])
            .unwrap();
        let uds = home.path().join("vsock");
        let stop = listen(vols.clone(), "sb".into(), &uds).unwrap();
        let sock = format!("{}_{}", uds.display(), wire::VOLUME_PORT);
        // A volume the sandbox does not mount is refused.
        let mut s = UnixStream::connect(&sock).unwrap();
        let (r, _) = call(
            &mut s,
            &Request::Hello {
                volume: "other".into(),
            },
            &[],
        );
        assert_eq!(r.errno, libc::ENOENT);
        let mut s = UnixStream::connect(&sock).unwrap();
        let (r, _) = call(&mut s, &Request::Hello { volume: "v".into() }, &[]);
        assert_eq!(r.errno, 0);
        let open = Request::Open {
            path: "f".into(),
            create: true,
            excl: false,
            trunc: true,
            mode: 0o644,
        };
        let (r, _) = call(&mut s, &open, &[]);
        let o: Opened = serde_json::from_value(r.body).unwrap();
        let (r, _) = call(&mut s, &Request::Write { fh: o.fh, off: 0 }, b"hello");
        assert_eq!(r.errno, 0);
        // Past the cap: ENOSPC.
        let (r, _) = call(&mut s, &Request::Write { fh: o.fh, off: 0 }, &[0; 1001]);
        assert_eq!(r.errno, libc::ENOSPC);
        let (r, _) = call(&mut s, &Request::Release { fh: o.fh }, &[]);
        assert_eq!(r.errno, 0);
        let read = Request::Read {
            path: "f".into(),
            fh: None,
            off: 0,
            len: 100,
        };
        assert_eq!(call(&mut s, &read, &[]).1, b"hello");
        let (r, _) = call(
            &mut s,
            &Request::Stat {
                path: "../v".into(),
                fh: None,
            },
            &[],
        );
        assert_ne!(r.errno, 0);
        // A connection dropped mid-write leaves the old content.
        let reopen = Request::Open {
            path: "f".into(),
            create: false,
            excl: false,
            trunc: true,
            mode: 0o644,
        };
        let (r, _) = call(&mut s, &reopen, &[]);
        let o: Opened = serde_json::from_value(r.body).unwrap();
        call(&mut s, &Request::Write { fh: o.fh, off: 0 }, b"torn");
        drop(s);
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(
            vols.vol("v").unwrap().read_at("f", 0, 100).unwrap(),
            b"hello"
        );
        assert_eq!(vols.vol("v").unwrap().used(), 5);
        stop.store(true, Ordering::Relaxed);
    }
}

//! The client's file and process calls (a child module of [`crate::client`], so that the
//! shared client file stays small).

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use super::{unexpected, Client, ClientError, ExecEnd, OutputStream, RequestRef, Transport};
use crate::protocol::{
    self, binary_header, Call, DirEntry, EndStatus, EventKind, ExecRequest, ExitStatus, FileInfo,
    FileListRequest, FileReadRequest, FileRemoveRequest, FileRenameRequest, FileStat,
    FileWatchRequest, FileWriteRequest, FsOp, PathRequest, PidRequest, ProcessInfo,
    ProcessResizeRequest, ProcessSignalRequest, StdinWriteRequest, BINARY_HEADER_LEN,
    MAX_BINARY_CHUNK, MAX_FRAME,
};

/// Options of [`Client::file_write`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FileWriteOptions {
    /// Permission bits of the file (default `0o644`).
    pub mode: Option<u32>,
    /// Append instead of replacing.
    pub append: bool,
    /// Create missing parent directories (default true).
    pub create_dirs: Option<bool>,
}

/// How an attached process ended (see [`Client::process_attach`]).
pub type ProcessEnd = ExecEnd;

impl<S: Transport> Client<S> {
    /// `file_read`: writes the bytes of `path` (from `offset`, at most `length`) to `out` as
    /// they arrive, returning the file's metadata. Memory stays bounded (one binary frame, at
    /// most 1 MiB, at a time).
    pub fn file_read(
        &mut self,
        path: &str,
        offset: Option<u64>,
        length: Option<u64>,
        timeout: Duration,
        out: &mut impl Write,
    ) -> Result<FileInfo, ClientError> {
        let call = Call::FileRead(FileReadRequest {
            path: path.into(),
            offset,
            length,
        });
        let mut info = None;
        let mut ended = false;
        let mut sink = |data: &[u8]| -> Result<(), ClientError> {
            if ended {
                return Err(ClientError::Protocol(
                    "file_read: data after the end frame".into(),
                ));
            }
            if data.is_empty() {
                ended = true;
                return Ok(());
            }
            out.write_all(data).map_err(|source| ClientError::Io {
                context: "writing file_read data".into(),
                source,
            })
        };
        self.call_with_data(
            &call,
            timeout,
            |event| match event {
                EventKind::FileInfo(i) if info.is_none() => {
                    info = Some(i);
                    Ok(())
                }
                other => Err(unexpected("file_read", &other)),
            },
            Some(&mut sink),
        )?;
        if !ended {
            return Err(ClientError::Protocol(
                "file_read ended without its end-of-data frame".into(),
            ));
        }
        info.ok_or_else(|| ClientError::Protocol("file_read ended without file_info".into()))
    }

    /// `file_read` of the whole file into memory.
    pub fn file_read_all(&mut self, path: &str, timeout: Duration) -> Result<Vec<u8>, ClientError> {
        let mut data = Vec::new();
        self.file_read(path, None, None, timeout, &mut data)?;
        Ok(data)
    }

    /// `file_write`: streams `data` to `path` in binary frames of at most 1 MiB as it reads
    /// them (one buffer, reused), then waits for `written`; returns the bytes written. An error
    /// the agent sends early stops the stream. If `data` fails, the write is abandoned (the
    /// agent writes nothing) and the error returned.
    pub fn file_write(
        &mut self,
        path: &str,
        opts: FileWriteOptions,
        data: &mut impl Read,
        timeout: Duration,
    ) -> Result<u64, ClientError> {
        if let Some(reason) = &self.broken {
            return Err(ClientError::Broken(reason.clone()));
        }
        let what = "file_write";
        let deadline = deadline_after(timeout);
        let call = Call::FileWrite(FileWriteRequest {
            path: path.into(),
            mode: opts.mode,
            append: opts.append,
            create_dirs: opts.create_dirs,
        });
        let id = self.next_id;
        self.next_id += 1;
        let mut frame = Vec::new();
        protocol::encode_frame(&RequestRef { id, call: &call }, &mut frame, MAX_FRAME)
            .map_err(ClientError::Frame)?;
        self.write_all_by(&frame, deadline, timeout, what)?;

        let mut buf = vec![0u8; BINARY_HEADER_LEN + MAX_BINARY_CHUNK];
        let mut source_error = None;
        loop {
            let n = match read_full(data, &mut buf[BINARY_HEADER_LEN..]) {
                Ok(n) => n,
                Err(e) => {
                    source_error = Some(e);
                    break;
                }
            };
            buf[..BINARY_HEADER_LEN].copy_from_slice(&binary_header(id, n));
            self.write_all_by(&buf[..BINARY_HEADER_LEN + n], deadline, timeout, what)?;
            if n == 0 {
                break;
            }
            if let Some(err) = self.early_error(id, deadline, timeout)? {
                // The agent refused before the end: stop sending, end the stream.
                self.write_all_by(&binary_header(id, 0), deadline, timeout, what)?;
                return Err(err);
            }
        }
        if let Some(source) = source_error {
            // Abandon: a request before the end frame makes the agent drop the data.
            let ping_id = self.next_id;
            self.next_id += 1;
            let mut ping = Vec::new();
            protocol::encode_frame(
                &RequestRef {
                    id: ping_id,
                    call: &Call::Ping,
                },
                &mut ping,
                MAX_FRAME,
            )
            .map_err(ClientError::Frame)?;
            self.write_all_by(&ping, deadline, timeout, what)?;
            let _ = self.finish_call(id, deadline, timeout, what, |_| Ok(()));
            return Err(ClientError::Io {
                context: "reading the data for file_write".into(),
                source,
            });
        }
        let mut written = None;
        self.finish_call(id, deadline, timeout, what, |event| match event {
            EventKind::Written { bytes, .. } if written.is_none() => {
                written = Some(bytes);
                Ok(())
            }
            other => Err(unexpected("file_write", &other)),
        })?;
        written.ok_or_else(|| ClientError::Protocol("file_write ended without written".into()))
    }

    /// An error the agent already sent about call `id` (or the connection), looked for
    /// without blocking; late events of abandoned calls are skipped.
    fn early_error(
        &mut self,
        id: u64,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Option<ClientError>, ClientError> {
        if self.reader.buffered().is_empty() {
            if let Err(e) = self.stream.set_read_timeout(Some(Duration::from_micros(1))) {
                return Err(self.io_error("setting a read timeout", e, timeout));
            }
            match self.reader.fill(&mut self.stream) {
                Ok(0) => {
                    self.broken = Some("the guest closed the connection".into());
                    return Err(ClientError::Closed);
                }
                Ok(_) => {}
                Err(e) if super::is_timeout(&e) => return Ok(None),
                Err(e) => return Err(self.io_error("file_write", e, timeout)),
            }
        }
        while !self.reader.buffered().is_empty() {
            let event = self.next_event(deadline, timeout, "file_write")?;
            match (event.id, event.event) {
                (x, EventKind::Error(info)) if x == id || x == protocol::CONNECTION_ID => {
                    return Ok(Some(ClientError::Remote(info)))
                }
                (x, other) if x == id => return Err(unexpected("file_write", &other)),
                _ => {} // a late event of an abandoned call
            }
        }
        Ok(None)
    }

    /// Reads the events of call `id` (already sent) until its terminal one.
    fn finish_call(
        &mut self,
        id: u64,
        deadline: Instant,
        timeout: Duration,
        what: &str,
        mut on_event: impl FnMut(EventKind) -> Result<(), ClientError>,
    ) -> Result<EndStatus, ClientError> {
        loop {
            let event = self.next_event(deadline, timeout, what)?;
            if event.id != id {
                if let (protocol::CONNECTION_ID, EventKind::Error(info)) = (event.id, &event.event)
                {
                    return Err(ClientError::Remote(info.clone()));
                }
                continue;
            }
            match event.event {
                EventKind::End { status, .. } => return Ok(status),
                EventKind::Error(info) => return Err(ClientError::Remote(info)),
                EventKind::Unknown => {}
                other => on_event(other)?,
            }
        }
    }

    /// `file_list`: the entries under `path`, `depth` levels deep (default 1).
    pub fn file_list(
        &mut self,
        path: &str,
        depth: Option<u32>,
    ) -> Result<Vec<DirEntry>, ClientError> {
        let call = Call::FileList(FileListRequest {
            path: path.into(),
            depth,
        });
        let mut all = Vec::new();
        self.call(&call, self.limits.timeout, |event| match event {
            EventKind::Entries { entries } => {
                all.extend(entries);
                Ok(())
            }
            other => Err(unexpected("file_list", &other)),
        })?;
        Ok(all)
    }

    /// `file_stat`.
    pub fn file_stat(&mut self, path: &str) -> Result<FileStat, ClientError> {
        let call = Call::FileStat(PathRequest { path: path.into() });
        let mut stat = None;
        self.call(&call, self.limits.timeout, |event| match event {
            EventKind::Stat { stat: s } if stat.is_none() => {
                stat = Some(s);
                Ok(())
            }
            other => Err(unexpected("file_stat", &other)),
        })?;
        stat.ok_or_else(|| ClientError::Protocol("file_stat ended without stat".into()))
    }

    /// `file_mkdir` (`mkdir -p`).
    pub fn file_mkdir(&mut self, path: &str) -> Result<(), ClientError> {
        self.simple(&Call::FileMkdir(PathRequest { path: path.into() }))
    }

    /// `file_remove`.
    pub fn file_remove(&mut self, path: &str, recursive: bool) -> Result<(), ClientError> {
        self.simple(&Call::FileRemove(FileRemoveRequest {
            path: path.into(),
            recursive,
        }))
    }

    /// `file_rename`.
    pub fn file_rename(&mut self, from: &str, to: &str) -> Result<(), ClientError> {
        self.simple(&Call::FileRename(FileRenameRequest {
            from: from.into(),
            to: to.into(),
        }))
    }

    /// `file_watch`: hands each change to `on_event` until it returns false or `timeout`
    /// passes (a normal end), then stops the watch (an empty binary frame with its id) and
    /// waits for its `end`.
    pub fn file_watch(
        &mut self,
        path: &str,
        recursive: bool,
        timeout: Duration,
        mut on_event: impl FnMut(&str, FsOp) -> bool,
    ) -> Result<(), ClientError> {
        if let Some(reason) = &self.broken {
            return Err(ClientError::Broken(reason.clone()));
        }
        let what = "file_watch";
        let call = Call::FileWatch(FileWatchRequest {
            path: path.into(),
            recursive,
        });
        let id = self.next_id;
        self.next_id += 1;
        let mut frame = Vec::new();
        protocol::encode_frame(&RequestRef { id, call: &call }, &mut frame, MAX_FRAME)
            .map_err(ClientError::Frame)?;
        let deadline = deadline_after(timeout);
        self.write_all_by(&frame, deadline, timeout, what)?;
        let mut stopping = false;
        let mut stop_deadline = deadline;
        loop {
            let event = match self.next_event(stop_deadline, timeout, what) {
                Ok(event) => event,
                Err(ClientError::Timeout { .. }) if !stopping => {
                    stopping = true;
                    stop_deadline = deadline_after(self.limits.timeout);
                    self.write_all_by(&binary_header(id, 0), stop_deadline, timeout, what)?;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if event.id != id {
                if let (protocol::CONNECTION_ID, EventKind::Error(info)) = (event.id, &event.event)
                {
                    return Err(ClientError::Remote(info.clone()));
                }
                continue;
            }
            match event.event {
                EventKind::End { .. } => return Ok(()),
                EventKind::Error(info) => return Err(ClientError::Remote(info)),
                EventKind::FsEvent { path, op } => {
                    if !stopping && !on_event(&path, op) {
                        stopping = true;
                        stop_deadline = deadline_after(self.limits.timeout);
                        self.write_all_by(&binary_header(id, 0), stop_deadline, timeout, what)?;
                    }
                }
                EventKind::Unknown => {}
                other => return Err(unexpected("file_watch", &other)),
            }
        }
    }

    /// `exec` with `background: true`: starts the program and returns its pid at once.
    pub fn exec_start(&mut self, req: &ExecRequest) -> Result<i32, ClientError> {
        let mut req = req.clone();
        req.background = true;
        let mut pid = None;
        self.call(&Call::Exec(req), self.limits.timeout, |event| match event {
            EventKind::Started { pid: p } if pid.is_none() => {
                pid = Some(p);
                Ok(())
            }
            other => Err(unexpected("exec", &other)),
        })?;
        pid.ok_or_else(|| ClientError::Protocol("exec ended without started".into()))
    }

    /// Foreground `exec`, telling `on_started` the pid before any output (so that another
    /// connection can write its stdin or signal it).
    pub fn exec_observed(
        &mut self,
        req: &ExecRequest,
        mut on_started: impl FnMut(i32),
        mut on_output: impl FnMut(OutputStream, &[u8]) -> Result<(), ClientError>,
    ) -> Result<ExecEnd, ClientError> {
        let timeout = match req.timeout_ms {
            Some(ms) => Duration::from_millis(ms).saturating_add(self.limits.exec_grace),
            None => self.limits.timeout,
        };
        let mut status = None;
        let end = self.call(&Call::Exec(req.clone()), timeout, |event| {
            output_event("exec", event, &mut status, &mut on_started, &mut on_output)
        })?;
        let status = status
            .ok_or_else(|| ClientError::Protocol("exec ended without an exit event".into()))?;
        Ok(ExecEnd {
            status,
            timed_out: end == EndStatus::TimedOut,
        })
    }

    /// `stdin_write`.
    pub fn stdin_write(&mut self, pid: i32, data: &[u8]) -> Result<(), ClientError> {
        self.simple(&Call::StdinWrite(StdinWriteRequest {
            pid,
            data: data.to_vec(),
        }))
    }

    /// `stdin_close`.
    pub fn stdin_close(&mut self, pid: i32) -> Result<(), ClientError> {
        self.simple(&Call::StdinClose(PidRequest { pid }))
    }

    /// `process_list`.
    pub fn process_list(&mut self) -> Result<Vec<ProcessInfo>, ClientError> {
        let mut list = None;
        self.call(
            &Call::ProcessList,
            self.limits.timeout,
            |event| match event {
                EventKind::Processes { processes } if list.is_none() => {
                    list = Some(processes);
                    Ok(())
                }
                other => Err(unexpected("process_list", &other)),
            },
        )?;
        list.ok_or_else(|| ClientError::Protocol("process_list ended without processes".into()))
    }

    /// `process_attach`: the output kept so far and then live output go to `on_output` until
    /// the process ends (within `timeout`).
    pub fn process_attach(
        &mut self,
        pid: i32,
        timeout: Duration,
        mut on_output: impl FnMut(OutputStream, &[u8]) -> Result<(), ClientError>,
    ) -> Result<ProcessEnd, ClientError> {
        let mut status = None;
        let end = self.call(&Call::ProcessAttach(PidRequest { pid }), timeout, |event| {
            output_event(
                "process_attach",
                event,
                &mut status,
                &mut |_| {},
                &mut on_output,
            )
        })?;
        let status = status.ok_or_else(|| {
            ClientError::Protocol("process_attach ended without an exit event".into())
        })?;
        Ok(ExecEnd {
            status,
            timed_out: end == EndStatus::TimedOut,
        })
    }

    /// `process_signal` (to the process group).
    pub fn process_signal(&mut self, pid: i32, signal: i32) -> Result<(), ClientError> {
        self.simple(&Call::ProcessSignal(ProcessSignalRequest { pid, signal }))
    }

    /// `process_resize` (pty only).
    pub fn process_resize(&mut self, pid: i32, cols: u16, rows: u16) -> Result<(), ClientError> {
        self.simple(&Call::ProcessResize(ProcessResizeRequest {
            pid,
            cols,
            rows,
        }))
    }

    /// A call answered with `end` alone.
    fn simple(&mut self, call: &Call) -> Result<(), ClientError> {
        let name = call.type_name();
        self.call(call, self.limits.timeout, |event| {
            Err(unexpected(name, &event))
        })?;
        Ok(())
    }
}

/// Receives output chunks.
type OutputFn<'a> = &'a mut dyn FnMut(OutputStream, &[u8]) -> Result<(), ClientError>;

fn output_event(
    call: &str,
    event: EventKind,
    status: &mut Option<ExitStatus>,
    on_started: &mut dyn FnMut(i32),
    on_output: OutputFn<'_>,
) -> Result<(), ClientError> {
    match event {
        EventKind::Started { pid } if status.is_none() => {
            on_started(pid);
            Ok(())
        }
        EventKind::Stdout { data } if status.is_none() => on_output(OutputStream::Stdout, &data),
        EventKind::Stderr { data } if status.is_none() => on_output(OutputStream::Stderr, &data),
        EventKind::Exit(s) if status.is_none() => {
            *status = Some(s);
            Ok(())
        }
        other => Err(unexpected(call, &other)),
    }
}

fn deadline_after(timeout: Duration) -> Instant {
    Instant::now()
        .checked_add(timeout)
        .unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 24 * 3600))
}

/// Reads until `buf` is full or EOF; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{decode_request, encode_binary_frame, Event, FrameReader, Pong};
    use std::os::unix::net::UnixStream;

    /// A fake guest answering the first request with `answer(id)`.
    fn guest_answering(answer: fn(u64) -> Vec<u8>) -> Client<UnixStream> {
        let (host, mut guest) = UnixStream::pair().unwrap();
        std::thread::spawn(move || {
            let mut reader = FrameReader::new(MAX_FRAME);
            let Ok(Some(body)) = reader.read_frame(&mut guest) else {
                return;
            };
            let id = decode_request(body).unwrap().id;
            let _ = guest.write_all(&answer(id));
            std::thread::sleep(Duration::from_millis(200));
        });
        Client::new(host)
    }

    fn event(id: u64, event: EventKind, out: &mut Vec<u8>) {
        protocol::encode_frame(&Event { id, event }, out, MAX_FRAME).unwrap();
    }

    #[test]
    fn binary_frames_are_refused_outside_file_read() {
        let mut client = guest_answering(|id| {
            let mut out = Vec::new();
            encode_binary_frame(id, b"junk", &mut out).unwrap();
            event(
                id,
                EventKind::Pong(Pong {
                    uptime_ms: 1,
                    boot_id: None,
                    protocol: 2,
                    agent_version: String::new(),
                }),
                &mut out,
            );
            event(id, EventKind::end(EndStatus::Ok), &mut out);
            out
        });
        let err = client.ping().unwrap_err();
        assert!(matches!(err, ClientError::Protocol(_)), "{err}");
        assert!(matches!(client.ping().unwrap_err(), ClientError::Broken(_)));
    }

    #[test]
    fn file_read_needs_its_end_frame_and_bounded_chunks() {
        let mut client = guest_answering(|id| {
            let mut out = Vec::new();
            let info = FileInfo {
                size: 2,
                mode: 0o100644,
                mtime_ms: 0,
            };
            event(id, EventKind::FileInfo(info), &mut out);
            encode_binary_frame(id, b"hi", &mut out).unwrap();
            event(id, EventKind::end(EndStatus::Ok), &mut out);
            out
        });
        let err = client
            .file_read("/f", None, None, Duration::from_secs(5), &mut Vec::new())
            .unwrap_err();
        assert!(matches!(err, ClientError::Protocol(_)), "{err}");

        let mut client = guest_answering(|id| {
            let mut out = Vec::new();
            out.extend_from_slice(&binary_header(id, MAX_BINARY_CHUNK + 1));
            out.resize(out.len() + MAX_BINARY_CHUNK + 1, 0);
            out
        });
        let err = client
            .file_read("/f", None, None, Duration::from_secs(5), &mut Vec::new())
            .unwrap_err();
        assert!(
            matches!(
                err,
                ClientError::Frame(protocol::FrameError::TooLarge { .. })
            ),
            "{err}"
        );
    }
}

//! Bridges between blocking runtime calls and HTTP bodies.
//!
//! A blocking call runs on a blocking thread and sends what it produces (NDJSON lines, file
//! bytes) through a bounded channel to the response body. When the client goes away, hyper
//! drops the body, the channel's receiver goes with it, the next send fails, and the call's
//! callback returns false (or its writer fails): the runtime stops the guest work. A slow
//! client slows the guest down instead of filling the server's memory.
//!
//! A call that produces nothing for a while (code sleeping in the guest) has no event whose
//! send could fail; for it the caller passes an `on_abandon` action (interrupt the context),
//! run as soon as the response (or the handler, while it waits) is dropped before the end.
//!
//! The response's status waits for the call's first message (at most [`FIRST_WAIT`]), so a
//! call that fails at once (no such sandbox, wrong state, no such file) gets its proper 4xx;
//! one that fails later ends its stream with an error line (NDJSON) or an aborted body (raw
//! bytes).

use std::io::{Read, Write};
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{Buf, Bytes};
use serde::Serialize;
use tokio::sync::mpsc;
use tracing::Span;

use super::error::ApiError;

/// How long a streamed response waits for the call's first output before it commits to
/// 200 and sends its headers.
pub const FIRST_WAIT: Duration = Duration::from_secs(5);

/// Messages from a blocking call to its response body.
#[derive(Debug)]
enum Msg {
    Data(Bytes),
    /// The end: a final NDJSON line (`Ok(Some)`), nothing more (`Ok(None)`), or an error.
    Done(Result<Option<Bytes>, ApiError>),
}

/// One NDJSON line.
pub fn line(v: &impl Serialize) -> Bytes {
    let mut b = serde_json::to_vec(v).unwrap_or_else(|e| {
        serde_json::to_vec(&serde_json::json!({
            "type": "error",
            "error": {"code": "internal", "message": format!("cannot encode an event: {e}")},
        }))
        .unwrap_or_default()
    });
    b.push(b'\n');
    Bytes::from(b)
}

/// What to do when the client goes away before the end of the call.
pub type OnAbandon = Box<dyn FnOnce() + Send + 'static>;

/// Runs its action (on a blocking thread) when dropped armed.
struct Abandon(Option<OnAbandon>);

impl Abandon {
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for Abandon {
    fn drop(&mut self) {
        let Some(f) = self.0.take() else {
            return;
        };
        tracing::info!("the client went away before the end of the call; stopping it");
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn_blocking(f);
            }
            Err(_) => {
                std::thread::spawn(f);
            }
        }
    }
}

/// Runs `call` on a blocking thread and streams its lines as `application/x-ndjson`: each
/// `emit(line)` is one line (false: the client is gone, stop), then the call's result
/// becomes the final line (`Ok(value)`) or `{"type":"error","error":{..}}`. `on_abandon`
/// runs if the client goes away before that.
pub async fn ndjson<F>(call: F, on_abandon: Option<OnAbandon>) -> Response
where
    F: FnOnce(&mut dyn FnMut(Bytes) -> bool) -> Result<serde_json::Value, ApiError>
        + Send
        + 'static,
{
    let abandon = Abandon(on_abandon);
    let (tx, rx) = mpsc::channel::<Msg>(32);
    let span = Span::current();
    tokio::task::spawn_blocking(move || {
        let _enter = span.enter();
        let data = tx.clone();
        let mut emit = |b: Bytes| data.blocking_send(Msg::Data(b)).is_ok();
        let r = call(&mut emit).map(|v| Some(line(&v)));
        let _ = tx.blocking_send(Msg::Done(r));
    });
    respond(rx, "application/x-ndjson", None, true, abandon, native).await
}

/// The native API's error response.
fn native(e: ApiError) -> Response {
    e.into_response()
}

/// Runs `call` on a blocking thread with a writer whose bytes become the response body
/// (`application/octet-stream`). A failure after the first bytes aborts the body, so the
/// client sees a truncated transfer, never a short file that looks complete.
pub async fn raw<F>(call: F, content_length: Option<u64>) -> Response
where
    F: FnOnce(&mut dyn Write) -> Result<(), ApiError> + Send + 'static,
{
    raw_with(call, content_length, native).await
}

/// [`raw`], with a failure before the first byte answered by `render` (a surface with an
/// error shape of its own: E2B's).
pub async fn raw_with<F>(
    call: F,
    content_length: Option<u64>,
    render: fn(ApiError) -> Response,
) -> Response
where
    F: FnOnce(&mut dyn Write) -> Result<(), ApiError> + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<Msg>(16);
    let span = Span::current();
    tokio::task::spawn_blocking(move || {
        let _enter = span.enter();
        let mut w = std::io::BufWriter::with_capacity(64 << 10, ChannelWriter { tx: tx.clone() });
        let r = call(&mut w).and_then(|_| {
            w.flush()
                .map_err(|e| ApiError::internal(format!("streaming the body: {e}")))
        });
        // On failure, what is still buffered is dropped, not sent (so an early failure is
        // still answered with its status).
        let _ = w.into_parts();
        let _ = tx.blocking_send(Msg::Done(r.map(|_| None)));
    });
    respond(
        rx,
        "application/octet-stream",
        content_length,
        false,
        Abandon(None),
        render,
    )
    .await
}

async fn respond(
    mut rx: mpsc::Receiver<Msg>,
    content_type: &'static str,
    content_length: Option<u64>,
    ndjson: bool,
    mut abandon: Abandon,
    render: fn(ApiError) -> Response,
) -> Response {
    let first = match tokio::time::timeout(FIRST_WAIT, rx.recv()).await {
        Ok(Some(Msg::Done(Err(e)))) => {
            abandon.disarm();
            return render(e);
        }
        Ok(Some(m)) => Some(m),
        Ok(None) => {
            abandon.disarm();
            return render(ApiError::internal("the call ended without a result"));
        }
        Err(_) => None,
    };
    let stream = futures_util::stream::unfold(
        (first, rx, false, abandon),
        move |(pending, mut rx, done, mut abandon)| async move {
            if done {
                return None;
            }
            let msg = match pending {
                Some(m) => m,
                None => match rx.recv().await {
                    Some(m) => m,
                    // The blocking task ended without its Done (it panicked).
                    None if ndjson => {
                        abandon.disarm();
                        let e = ApiError::internal("the call ended without a result");
                        return Some((Ok(error_line(&e)), (None, rx, true, abandon)));
                    }
                    None => {
                        abandon.disarm();
                        return Some((
                            Err(std::io::Error::other("the call failed")),
                            (None, rx, true, abandon),
                        ));
                    }
                },
            };
            if matches!(msg, Msg::Done(_)) {
                // The call is over: nothing to stop any more.
                abandon.disarm();
            }
            let item = match msg {
                Msg::Data(b) => return Some((Ok(b), (None, rx, false, abandon))),
                Msg::Done(Ok(Some(b))) => Ok(b),
                Msg::Done(Ok(None)) => return None,
                Msg::Done(Err(e)) if ndjson => Ok(error_line(&e)),
                Msg::Done(Err(e)) => {
                    tracing::warn!(code = %e.code, "stream aborted: {}", e.message);
                    Err(std::io::Error::other(e.message))
                }
            };
            Some((item, (None, rx, true, abandon)))
        },
    );
    let mut resp = Response::new(Body::from_stream(stream));
    *resp.status_mut() = StatusCode::OK;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    if let Some(n) = content_length {
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
    }
    resp
}

/// `{"type":"error","error":{"code","message"}}` as a line.
pub fn error_line(e: &ApiError) -> Bytes {
    line(&serde_json::json!({"type": "error", "error": e.body().error}))
}

/// A writer whose bytes go to a response body.
struct ChannelWriter {
    tx: mpsc::Sender<Msg>,
}

impl Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.tx
            .blocking_send(Msg::Data(Bytes::copy_from_slice(buf)))
            .map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the client went away")
            })?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Feeds a request body, chunk by chunk, into `tx` (the channel a [`ChannelReader`] reads)
/// until it ends, fails or passes `limit` bytes; the reader sees an error in the last two
/// cases. Returns whether the body passed the limit.
pub async fn pump_body<S, E>(
    mut body: S,
    tx: mpsc::Sender<std::io::Result<Bytes>>,
    limit: u64,
) -> bool
where
    S: futures_util::Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    use futures_util::StreamExt;
    let mut n = 0u64;
    let mut over = false;
    while let Some(chunk) = body.next().await {
        let item = match chunk {
            Ok(c) => {
                n += c.len() as u64;
                if n > limit {
                    over = true;
                    Err(std::io::Error::other("the upload is over the limit"))
                } else {
                    Ok(c)
                }
            }
            Err(e) => Err(std::io::Error::other(format!(
                "the request body was cut off: {e}"
            ))),
        };
        let stop = item.is_err();
        if tx.send(item).await.is_err() || stop {
            break;
        }
    }
    over
}

/// A blocking reader over request body chunks sent by the async side ([`pump_body`]); an
/// `Err` item fails the read (the body was cut off or is over the limit), the channel's end
/// is EOF.
#[derive(Debug)]
pub struct ChannelReader {
    rx: mpsc::Receiver<std::io::Result<Bytes>>,
    cur: Bytes,
}

impl ChannelReader {
    /// A reader of what arrives on `rx`.
    pub fn new(rx: mpsc::Receiver<std::io::Result<Bytes>>) -> Self {
        ChannelReader {
            rx,
            cur: Bytes::new(),
        }
    }
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(b)) => self.cur = b,
                Some(Err(e)) => return Err(e),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.cur.len());
        buf[..n].copy_from_slice(&self.cur[..n]);
        self.cur.advance(n);
        Ok(n)
    }
}

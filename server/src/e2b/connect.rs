//! The Connect protocol (<https://connectrpc.com/docs/protocol>) as the E2B SDKs speak it to
//! envd: the JSON codec only, no compression.
//!
//! - **Unary** calls: the request body is one JSON message (`application/json`); the answer is
//!   200 with one JSON message, or an error status with `{"code": "not_found", "message": …}`
//!   (see [`Code::http_status`]).
//! - **Streaming** calls (server, client, bidi): both bodies are sequences of *envelopes*, a
//!   5-byte prefix (`flags: u8`, `length: u32` big-endian) and the JSON message
//!   (`application/connect+json`). A response stream ends with an envelope whose flags have
//!   [`END_STREAM`] set, holding `{}` or `{"error": {…}}`; errors after the headers (and, for
//!   simplicity and as connect-go does for streams, before them too) travel in it under
//!   HTTP 200.
//! - **ProtoJSON**: lowerCamelCase names out, both names accepted in; 64-bit integers as
//!   strings out, numbers or strings accepted in; `bytes` as standard base64 out, standard or
//!   URL-safe, padded or not, in; enums by name out, names or numbers in; zero values left
//!   out; unknown fields ignored; `null` is the default value; `Timestamp` as RFC 3339.
//!   The helpers in [`pj`] do the input side for hand-written serde structs.
//!
//! Limits: one message is at most [`MAX_MESSAGE`] bytes; an envelope announcing more is
//! refused from its header, before anything is allocated for it.

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Flag of a compressed envelope (refused: the SDKs send `identity`).
pub const COMPRESSED: u8 = 0x01;
/// Flag of the end-of-stream envelope.
pub const END_STREAM: u8 = 0x02;
/// Largest message accepted in a request (a unary body or one envelope): 16 MiB.
pub const MAX_MESSAGE: usize = 16 << 20;
/// The content type of unary JSON messages.
pub const UNARY_JSON: &str = "application/json";
/// The content type of enveloped (streaming) JSON messages.
pub const STREAM_JSON: &str = "application/connect+json";

/// Connect error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// The operation was cancelled.
    Canceled,
    /// Unknown error.
    Unknown,
    /// The request is invalid.
    InvalidArgument,
    /// The deadline passed.
    DeadlineExceeded,
    /// Something requested was not found.
    NotFound,
    /// What the request creates already exists.
    AlreadyExists,
    /// The caller may not do that.
    PermissionDenied,
    /// A limit was reached.
    ResourceExhausted,
    /// The system is not in a state that allows the operation.
    FailedPrecondition,
    /// The operation was aborted.
    Aborted,
    /// Out of range.
    OutOfRange,
    /// The method is not implemented.
    Unimplemented,
    /// An internal error.
    Internal,
    /// The service is unavailable.
    Unavailable,
    /// Data was lost.
    DataLoss,
    /// The caller is not authenticated.
    Unauthenticated,
}

impl Code {
    /// The code's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (the Connect protocol's table).
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::FailedPrecondition => StatusCode::PRECONDITION_FAILED,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A Connect error: a code and a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ConnectError {
    /// The code.
    pub code: Code,
    /// What went wrong, for people.
    pub message: String,
}

impl ConnectError {
    /// An error with this code and message.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        ConnectError {
            code,
            message: message.into(),
        }
    }

    /// `invalid_argument`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    /// `not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }

    /// `internal`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }

    /// The error's JSON object, `{"code", "message"}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }

    /// The answer to a unary call that failed: the mapped status, the JSON body.
    pub fn unary_response(&self) -> Response {
        if self.code.http_status().is_server_error() {
            tracing::warn!(code = %self.code, "rpc failed: {}", self.message);
        }
        let body = serde_json::to_vec(&self.to_json()).unwrap_or_default();
        let mut resp = (self.code.http_status(), body).into_response();
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(UNARY_JSON));
        resp
    }
}

// ------------------------------------------------------------------------------------------
// Envelopes

/// One envelope of a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// Its flags ([`COMPRESSED`], [`END_STREAM`]).
    pub flags: u8,
    /// Its message.
    pub data: Bytes,
}

/// Encodes one envelope.
pub fn envelope(flags: u8, data: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + data.len());
    b.put_u8(flags);
    b.put_u32(u32::try_from(data.len()).unwrap_or(u32::MAX));
    b.put_slice(data);
    b.freeze()
}

/// A message envelope holding `msg` as JSON.
pub fn message_frame(msg: &impl Serialize) -> Bytes {
    match serde_json::to_vec(msg) {
        Ok(v) => envelope(0, &v),
        Err(e) => end_frame(Some(&ConnectError::internal(format!(
            "cannot encode a message: {e}"
        )))),
    }
}

/// The end-of-stream envelope: `{}`, or `{"error": {…}}`.
pub fn end_frame(error: Option<&ConnectError>) -> Bytes {
    let body = match error {
        None => b"{}".to_vec(),
        Some(e) => serde_json::to_vec(&serde_json::json!({"error": e.to_json()}))
            .unwrap_or_else(|_| b"{}".to_vec()),
    };
    envelope(END_STREAM, &body)
}

/// Splits a byte stream that arrives in arbitrary chunks into envelopes.
#[derive(Debug)]
pub struct EnvelopeDecoder {
    buf: BytesMut,
    max: usize,
}

impl EnvelopeDecoder {
    /// A decoder refusing messages over `max` bytes.
    pub fn new(max: usize) -> Self {
        EnvelopeDecoder {
            buf: BytesMut::new(),
            max,
        }
    }

    /// Adds received bytes.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// Bytes received but not yet returned as envelopes.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next complete envelope, if one is buffered. An envelope announcing more than the
    /// limit, or a compressed one, is an error as soon as its header is here.
    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, ConnectError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > self.max {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!(
                    "a message of {len} bytes is over the limit of {} bytes",
                    self.max
                ),
            ));
        }
        if flags & COMPRESSED != 0 {
            return Err(ConnectError::new(
                Code::Unimplemented,
                "compressed messages are not supported (send Connect-Content-Encoding: identity)",
            ));
        }
        if flags & !(COMPRESSED | END_STREAM) != 0 {
            return Err(ConnectError::invalid(format!(
                "unknown envelope flags {flags:#04x}"
            )));
        }
        if self.buf.len() < 5 + len {
            // Room for the rest, now that the length is known to be sane.
            self.buf.reserve(5 + len - self.buf.len());
            return Ok(None);
        }
        self.buf.advance(5);
        let data = self.buf.split_to(len).freeze();
        Ok(Some(Envelope { flags, data }))
    }
}

/// Reads a request body's envelopes one at a time.
pub struct EnvelopeReader {
    body: axum::body::BodyDataStream,
    dec: EnvelopeDecoder,
    done: bool,
}

impl std::fmt::Debug for EnvelopeReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvelopeReader")
            .field("pending", &self.dec.pending())
            .finish_non_exhaustive()
    }
}

impl EnvelopeReader {
    /// A reader of `body`.
    pub fn new(body: Body) -> Self {
        EnvelopeReader {
            body: body.into_data_stream(),
            dec: EnvelopeDecoder::new(MAX_MESSAGE),
            done: false,
        }
    }

    /// The next message envelope's bytes; `None` at the end of the body (or at an
    /// end-of-stream envelope). A body that stops inside an envelope is an error.
    pub async fn next(&mut self) -> Result<Option<Bytes>, ConnectError> {
        loop {
            if let Some(env) = self.dec.next_envelope()? {
                if env.flags & END_STREAM != 0 {
                    self.done = true;
                    return Ok(None);
                }
                return Ok(Some(env.data));
            }
            if self.done {
                return Ok(None);
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.dec.push(&chunk),
                Some(Err(e)) => {
                    return Err(ConnectError::new(
                        Code::Canceled,
                        format!("cannot read the request body: {e}"),
                    ))
                }
                None => {
                    self.done = true;
                    if self.dec.pending() > 0 {
                        return Err(ConnectError::invalid(format!(
                            "the request body ended inside a message ({} bytes left over)",
                            self.dec.pending()
                        )));
                    }
                    return Ok(None);
                }
            }
        }
    }

    /// The next message, decoded.
    pub async fn next_message<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ConnectError> {
        match self.next().await? {
            Some(b) => decode(&b).map(Some),
            None => Ok(None),
        }
    }
}

/// Decodes one JSON message (an empty body is the empty message).
pub fn decode<T: DeserializeOwned>(data: &[u8]) -> Result<T, ConnectError> {
    let text: &[u8] = if data.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        data
    };
    serde_json::from_slice(text).map_err(|e| ConnectError::invalid(format!("invalid message: {e}")))
}

/// Reads a whole unary request body (at most [`MAX_MESSAGE`] bytes) and decodes it.
pub async fn read_unary<T: DeserializeOwned>(body: Body) -> Result<T, ConnectError> {
    let mut out = BytesMut::new();
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            ConnectError::new(Code::Canceled, format!("cannot read the request body: {e}"))
        })?;
        if out.len() + chunk.len() > MAX_MESSAGE {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!("the request body is over the limit of {MAX_MESSAGE} bytes"),
            ));
        }
        out.extend_from_slice(&chunk);
    }
    decode(&out)
}

/// Reads the single message of a server-streaming request.
pub async fn read_stream_request<T: DeserializeOwned>(body: Body) -> Result<T, ConnectError> {
    let mut r = EnvelopeReader::new(body);
    match r.next_message().await? {
        Some(m) => Ok(m),
        None => Err(ConnectError::invalid("the request stream holds no message")),
    }
}

/// A unary success: 200 with `msg` as JSON.
pub fn unary_ok(msg: &impl Serialize) -> Response {
    match serde_json::to_vec(msg) {
        Ok(body) => {
            let mut resp = (StatusCode::OK, body).into_response();
            resp.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(UNARY_JSON));
            resp
        }
        Err(e) => ConnectError::internal(format!("cannot encode the answer: {e}")).unary_response(),
    }
}

/// A streaming response whose body is `frames` (envelopes, the last an end frame), 200,
/// `application/connect+json`. If the sender goes away without an end frame, one with an
/// `internal` error is added. `guard` is dropped with the body: when the client goes away,
/// or after the end.
pub fn stream_response<G: Send + 'static>(
    frames: tokio::sync::mpsc::Receiver<Bytes>,
    guard: G,
) -> Response {
    struct State<G> {
        rx: tokio::sync::mpsc::Receiver<Bytes>,
        ended: bool,
        _guard: G,
    }
    let st = State {
        rx: frames,
        ended: false,
        _guard: guard,
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        if st.ended {
            return None;
        }
        match st.rx.recv().await {
            Some(b) => {
                if b.first().is_some_and(|f| f & END_STREAM != 0) {
                    st.ended = true;
                }
                Some((Ok::<Bytes, std::io::Error>(b), st))
            }
            None => {
                st.ended = true;
                let e = ConnectError::internal("the call ended without an end of stream");
                Some((Ok(end_frame(Some(&e))), st))
            }
        }
    });
    stream_headers(Response::new(Body::from_stream(stream)))
}

/// A streaming response that holds only the end frame with `e` (a call that failed before
/// its first message).
pub fn stream_error(e: &ConnectError) -> Response {
    if e.code.http_status().is_server_error() {
        tracing::warn!(code = %e.code, "rpc failed: {}", e.message);
    }
    stream_headers(Response::new(Body::from(end_frame(Some(e)))))
}

/// A client-streaming call's answer: the message, then the end frame.
pub fn stream_single(msg: &impl Serialize) -> Response {
    let mut b = BytesMut::new();
    b.extend_from_slice(&message_frame(msg));
    b.extend_from_slice(&end_frame(None));
    stream_headers(Response::new(Body::from(b.freeze())))
}

fn stream_headers(mut resp: Response) -> Response {
    *resp.status_mut() = StatusCode::OK;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(STREAM_JSON));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

// ------------------------------------------------------------------------------------------
// Headers

/// `Connect-Timeout-Ms`: `None` when absent (or 0: no limit); at most 10 digits.
pub fn timeout(headers: &HeaderMap) -> Result<Option<Duration>, ConnectError> {
    let Some(v) = headers.get("connect-timeout-ms") else {
        return Ok(None);
    };
    let s = v.to_str().unwrap_or("").trim();
    if s.is_empty() || s.len() > 10 || !s.bytes().all(|c| c.is_ascii_digit()) {
        return Err(ConnectError::invalid(format!(
            "Connect-Timeout-Ms {s:?} is not a number of milliseconds (1 to 10 digits)"
        )));
    }
    let ms: u64 = s
        .parse()
        .map_err(|_| ConnectError::invalid(format!("Connect-Timeout-Ms {s:?}")))?;
    Ok((ms > 0).then(|| Duration::from_millis(ms)))
}

/// Default keepalive interval of streams when the client asks for none.
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(50);

/// `Keepalive-Ping-Interval` (seconds), default [`DEFAULT_KEEPALIVE`], at least 1 s.
pub fn keepalive(headers: &HeaderMap) -> Duration {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map(|s| Duration::from_secs(s.clamp(1, 3600)))
        .unwrap_or(DEFAULT_KEEPALIVE)
}

/// Whether the request's content type is the JSON codec in the expected framing
/// (`application/json` for unary, `application/connect+json` for streams).
pub fn check_content_type(headers: &HeaderMap, stream: bool) -> Result<(), ConnectError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let base = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let want = if stream { STREAM_JSON } else { UNARY_JSON };
    // A missing content type is taken as the expected one (curl, tests).
    if base.is_empty() || base == want {
        return Ok(());
    }
    Err(ConnectError::new(
        Code::Unimplemented,
        format!("content type {ct:?} is not served: this server speaks only {want} here"),
    ))
}

// ------------------------------------------------------------------------------------------
// ProtoJSON

/// ProtoJSON input helpers for `#[serde(deserialize_with = …)]` and output helpers.
pub mod pj {
    use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};
    use base64::engine::DecodePaddingMode;
    use base64::Engine as _;
    use serde::de::{self, Deserializer, Visitor};
    use serde::Deserialize;

    const LENIENT: GeneralPurposeConfig = GeneralPurposeConfig::new()
        .with_decode_padding_mode(DecodePaddingMode::Indifferent)
        .with_decode_allow_trailing_bits(true);
    const STANDARD: GeneralPurpose = GeneralPurpose::new(&base64::alphabet::STANDARD, LENIENT);
    const URL_SAFE: GeneralPurpose = GeneralPurpose::new(&base64::alphabet::URL_SAFE, LENIENT);

    /// `bytes` out: standard base64, padded.
    pub fn b64(data: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(data)
    }

    /// `bytes` in: standard or URL-safe base64, padded or not.
    pub fn b64_decode(s: &str) -> Result<Vec<u8>, String> {
        STANDARD
            .decode(s)
            .or_else(|_| URL_SAFE.decode(s))
            .map_err(|e| format!("invalid base64: {e}"))
    }

    /// Any field: `null` is the default value.
    pub fn or_default<'de, D, T>(d: D) -> Result<T, D::Error>
    where
        D: Deserializer<'de>,
        T: Deserialize<'de> + Default,
    {
        Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
    }

    /// A `bytes` field (`null`: empty).
    pub fn bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(Vec::new()),
            Some(s) => b64_decode(&s).map_err(de::Error::custom),
        }
    }

    /// An optional `bytes` field of a oneof (present, even empty, when the key is there).
    pub fn opt_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(None),
            Some(s) => b64_decode(&s).map(Some).map_err(de::Error::custom),
        }
    }

    struct IntVisitor;

    impl Visitor<'_> for IntVisitor {
        type Value = Option<i128>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an integer, as a JSON number or a string")
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Ok(Some(v.into()))
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v.into()))
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
            if v.fract() == 0.0 && v.abs() < 1e30 {
                Ok(Some(v as i128))
            } else {
                Err(E::custom(format!("{v} is not an integer")))
            }
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            let t = v.trim();
            if let Ok(n) = t.parse::<i128>() {
                return Ok(Some(n));
            }
            match t.parse::<f64>() {
                Ok(f) if f.fract() == 0.0 && f.abs() < 1e30 => Ok(Some(f as i128)),
                _ => Err(E::custom(format!("{v:?} is not an integer"))),
            }
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }

    fn int<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i128>, D::Error> {
        d.deserialize_any(IntVisitor)
    }

    /// A `uint32` (number or string; `null`: 0).
    pub fn u32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
        match int(d)? {
            None => Ok(0),
            Some(n) => {
                u32::try_from(n).map_err(|_| de::Error::custom(format!("{n} is not a uint32")))
            }
        }
    }

    /// An optional `uint32` of a oneof.
    pub fn opt_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        match int(d)? {
            None => Ok(None),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| de::Error::custom(format!("{n} is not a uint32"))),
        }
    }

    /// An `int64` (number or string; `null`: 0).
    pub fn i64<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
        match int(d)? {
            None => Ok(0),
            Some(n) => {
                i64::try_from(n).map_err(|_| de::Error::custom(format!("{n} is not an int64")))
            }
        }
    }

    /// An enum field: its name or its number (`null`: 0). Unknown names are an error.
    pub fn enum_value<'de, D: Deserializer<'de>>(
        d: D,
        names: &[(&str, i32)],
    ) -> Result<i32, D::Error> {
        let v = serde_json::Value::deserialize(d)?;
        match &v {
            serde_json::Value::Null => Ok(0),
            serde_json::Value::String(s) => names
                .iter()
                .find(|(n, _)| n == s)
                .map(|(_, v)| *v)
                .ok_or_else(|| de::Error::custom(format!("unknown enum value {s:?}"))),
            serde_json::Value::Number(n) => n
                .as_i64()
                .and_then(|n| i32::try_from(n).ok())
                .ok_or_else(|| de::Error::custom(format!("{n} is not an enum number"))),
            other => Err(de::Error::custom(format!("{other} is not an enum value"))),
        }
    }

    /// An `int64` out: a string.
    pub fn i64_out(n: i64) -> serde_json::Value {
        serde_json::Value::String(n.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    fn frames(msgs: &[(u8, &[u8])]) -> Vec<u8> {
        let mut out = Vec::new();
        for (f, d) in msgs {
            out.extend_from_slice(&envelope(*f, d));
        }
        out
    }

    #[test]
    fn envelopes_survive_every_chunk_split() {
        let msgs: Vec<(u8, &[u8])> = vec![
            (0, br#"{"a":1}"#),
            (0, b""),
            (0, br#"{"process":{"pid":7}}"#),
            (END_STREAM, b"{}"),
        ];
        let wire = frames(&msgs);
        for chunk in 1..=wire.len() {
            let mut dec = EnvelopeDecoder::new(1024);
            let mut got = Vec::new();
            for c in wire.chunks(chunk) {
                dec.push(c);
                while let Some(e) = dec.next_envelope().unwrap() {
                    got.push((e.flags, e.data.to_vec()));
                }
            }
            assert_eq!(dec.pending(), 0, "chunk size {chunk}");
            let want: Vec<(u8, Vec<u8>)> = msgs.iter().map(|(f, d)| (*f, d.to_vec())).collect();
            assert_eq!(got, want, "chunk size {chunk}");
        }
        // Two-way splits at every position, too.
        for cut in 0..=wire.len() {
            let mut dec = EnvelopeDecoder::new(1024);
            let mut n = 0;
            for part in [&wire[..cut], &wire[cut..]] {
                dec.push(part);
                while dec.next_envelope().unwrap().is_some() {
                    n += 1;
                }
            }
            assert_eq!(n, msgs.len());
        }
    }

    #[test]
    fn oversized_and_compressed_envelopes_are_refused_from_the_header() {
        let mut dec = EnvelopeDecoder::new(MAX_MESSAGE);
        dec.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        let e = dec.next_envelope().unwrap_err();
        assert_eq!(e.code, Code::ResourceExhausted);
        assert!(dec.buf.capacity() < 1 << 20, "nothing was reserved");
        let mut dec = EnvelopeDecoder::new(1024);
        dec.push(&[COMPRESSED, 0, 0, 0, 2, b'{', b'}']);
        assert_eq!(dec.next_envelope().unwrap_err().code, Code::Unimplemented);
        let mut dec = EnvelopeDecoder::new(1024);
        dec.push(&[0x80, 0, 0, 0, 0]);
        assert_eq!(dec.next_envelope().unwrap_err().code, Code::InvalidArgument);
    }

    #[test]
    fn end_frames() {
        assert_eq!(&end_frame(None)[..], b"\x02\x00\x00\x00\x02{}");
        let e = ConnectError::not_found("process 9 not found");
        let f = end_frame(Some(&e));
        assert_eq!(f[0], END_STREAM);
        let len = u32::from_be_bytes([f[1], f[2], f[3], f[4]]) as usize;
        assert_eq!(len, f.len() - 5);
        let v: serde_json::Value = serde_json::from_slice(&f[5..]).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": {"code": "not_found", "message": "process 9 not found"}})
        );
        let m = message_frame(&serde_json::json!({"event": {"start": {"pid": 12505}}}));
        assert_eq!(m[0], 0);
        assert_eq!(&m[5..], br#"{"event":{"start":{"pid":12505}}}"#);
    }

    #[test]
    fn error_codes_map_to_the_connect_statuses() {
        let cases = [
            (Code::NotFound, 404),
            (Code::AlreadyExists, 409),
            (Code::InvalidArgument, 400),
            (Code::Unauthenticated, 401),
            (Code::PermissionDenied, 403),
            (Code::ResourceExhausted, 429),
            (Code::Unavailable, 503),
            (Code::DeadlineExceeded, 504),
            (Code::Unimplemented, 501),
            (Code::Internal, 500),
            (Code::Unknown, 500),
            (Code::Canceled, 499),
        ];
        for (code, status) in cases {
            assert_eq!(code.http_status().as_u16(), status, "{code}");
        }
        let r = ConnectError::new(Code::AlreadyExists, "x").unary_response();
        assert_eq!(r.status(), 409);
        assert_eq!(r.headers()[header::CONTENT_TYPE], UNARY_JSON);
    }

    #[test]
    fn timeout_and_keepalive_headers() {
        let mut h = HeaderMap::new();
        assert_eq!(timeout(&h).unwrap(), None);
        h.insert("connect-timeout-ms", HeaderValue::from_static("60000"));
        assert_eq!(timeout(&h).unwrap(), Some(Duration::from_secs(60)));
        h.insert(
            "connect-timeout-ms",
            HeaderValue::from_static("12345678901"),
        );
        assert_eq!(timeout(&h).unwrap_err().code, Code::InvalidArgument);
        h.insert("connect-timeout-ms", HeaderValue::from_static("-5"));
        assert!(timeout(&h).is_err());
        assert_eq!(keepalive(&h), DEFAULT_KEEPALIVE);
        h.insert("keepalive-ping-interval", HeaderValue::from_static("5"));
        assert_eq!(keepalive(&h), Duration::from_secs(5));
    }

    #[derive(Debug, Default, Deserialize)]
    #[serde(default, rename_all = "camelCase")]
    struct Sample {
        #[serde(deserialize_with = "pj::or_default")]
        name: String,
        #[serde(deserialize_with = "pj::u32")]
        depth: u32,
        #[serde(deserialize_with = "pj::i64")]
        size: i64,
        #[serde(deserialize_with = "pj::bytes")]
        data: Vec<u8>,
        #[serde(alias = "watcher_id", deserialize_with = "pj::or_default")]
        watcher_id: String,
        #[serde(deserialize_with = "kind")]
        kind: i32,
    }

    fn kind<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
        pj::enum_value(d, &[("SIGNAL_SIGKILL", 9), ("SIGNAL_SIGTERM", 15)])
    }

    #[test]
    fn protojson_input() {
        let s: Sample = decode(
            br#"{"name":null,"depth":"3","size":10,"data":"aGkK","watcherId":"w1","kind":"SIGNAL_SIGKILL","extra":{"x":1}}"#,
        )
        .unwrap();
        assert_eq!((s.name.as_str(), s.depth, s.size), ("", 3, 10));
        assert_eq!(s.data, b"hi\n");
        assert_eq!(s.watcher_id, "w1");
        assert_eq!(s.kind, 9);
        let s: Sample =
            decode(br#"{"size":"-4","data":"aGk","watcher_id":"w2","kind":15,"depth":2.0}"#)
                .unwrap();
        assert_eq!(
            (s.size, s.data.as_slice(), s.watcher_id.as_str()),
            (-4, &b"hi"[..], "w2")
        );
        assert_eq!((s.kind, s.depth), (15, 2));
        let s: Sample = decode(br#"{"data":"_-8"}"#).unwrap();
        assert_eq!(s.data, [0xff, 0xef]);
        let s: Sample = decode(b"").unwrap();
        assert_eq!(s.depth, 0);
        assert!(decode::<Sample>(br#"{"depth":-1}"#).is_err());
        assert!(decode::<Sample>(br#"{"depth":1.5}"#).is_err());
        assert!(decode::<Sample>(br#"{"kind":"SIGNAL_NOPE"}"#).is_err());
        assert!(decode::<Sample>(br#"{"data":"!!"}"#).is_err());
        assert_eq!(pj::i64_out(10), serde_json::json!("10"));
        assert_eq!(pj::b64(b"hi\n"), "aGkK");
    }

    #[test]
    fn content_types() {
        let mut h = HeaderMap::new();
        assert!(check_content_type(&h, true).is_ok());
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/connect+json"),
        );
        assert!(check_content_type(&h, true).is_ok());
        assert!(check_content_type(&h, false).is_err());
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json; charset=utf-8"),
        );
        assert!(check_content_type(&h, false).is_ok());
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/proto"),
        );
        assert_eq!(
            check_content_type(&h, false).unwrap_err().code,
            Code::Unimplemented
        );
    }

    #[tokio::test]
    async fn reader_reads_a_chunked_body_and_refuses_a_cut_one() {
        let wire = frames(&[(0, br#"{"a":1}"#), (0, br#"{"a":2}"#)]);
        let chunks: Vec<Result<Bytes, std::io::Error>> = wire
            .chunks(3)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let body = Body::from_stream(futures_util::stream::iter(chunks));
        let mut r = EnvelopeReader::new(body);
        let a: serde_json::Value = r.next_message().await.unwrap().unwrap();
        let b: serde_json::Value = r.next_message().await.unwrap().unwrap();
        assert_eq!((a["a"].as_i64(), b["a"].as_i64()), (Some(1), Some(2)));
        assert!(r.next().await.unwrap().is_none());
        let cut = Body::from(wire[..wire.len() - 2].to_vec());
        let mut r = EnvelopeReader::new(cut);
        assert!(r.next().await.unwrap().is_some());
        assert_eq!(r.next().await.unwrap_err().code, Code::InvalidArgument);
    }
}

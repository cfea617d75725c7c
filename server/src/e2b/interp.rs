//! The code-interpreter surface (port 49999, `docs/e2b.md` §4): `/execute` streams the
//! agent's `run_code` events as E2B's NDJSON lines; `/contexts` maps to the agent's
//! contexts. Languages: `python` (default), `bash`, `javascript`, `typescript`, `r` and `java`
//! where the sandbox's template has them; one it lacks is refused with those it has.
//!
//! `/execute` lines: `stdout`/`stderr` (with `timestamp`), `result` (MIME bundle mapped to
//! E2B's keys, `is_main_result` true for the cell's value and false for displays), `error`
//! (`name`, `value`, `traceback`), `number_of_executions`, `keepalive` after every
//! [`KEEPALIVE`] without output, and always `end_of_execution` last. Never a blank line.
//! A client that goes away interrupts the code: its next output fails to send, or, if it
//! prints nothing, the call is cancelled when the response is dropped. Either way the call's
//! agent connection closes, and the agent interrupts that run (not the context's next one).

use ember_runtime::call::{self, Io};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Extension, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use bytes::Bytes;
use ember_runtime::call::{ContextInfo, ErrorCode, EventKind, RunCodeRequest};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use tower::ServiceExt;
use tracing::Span;

use super::target::{gone_or, Target};
use super::{E2bError, E2bJson, E2bState};
use crate::Backend;
use ember_runtime::RuntimeError;

/// Idle time after which `/execute` sends a `keepalive` line (as E2B's server does).
pub const KEEPALIVE: Duration = Duration::from_secs(5);

/// How long `/execute` waits for the first output before it commits to 200, so that a
/// call that fails at once (no such context) gets its status.
const FIRST_WAIT: Duration = Duration::from_secs(2);

/// The default working directory of new contexts (the user's home, as in E2B).
pub const DEFAULT_CWD: &str = "/home/user";

/// Serves one code-interpreter request (routed and authenticated by `route`) with `router`
/// (the surface's, built once).
pub async fn handle(router: &Router, req: Request) -> Response {
    match router.clone().oneshot(req).await {
        Ok(resp) => resp,
        Err(never) => match never {},
    }
}

pub(super) fn routes() -> Router<E2bState> {
    let routes = Router::new()
        .route("/execute", post(execute))
        .route("/contexts", post(create_context).get(list_contexts))
        .route("/contexts/{ctx}/restart", post(restart_context))
        .route("/contexts/{ctx}", delete(remove_context))
        .route("/health", get(|| async { StatusCode::OK }));
    super::with_fallbacks(routes, "the code interpreter")
}

/// The agent's language for an E2B language name (`None`: default python).
pub fn language(requested: Option<&str>) -> Result<Option<&'static str>, E2bError> {
    let Some(l) = requested.map(str::trim).filter(|l| !l.is_empty()) else {
        return Ok(None);
    };
    match ember_runtime::call::canonical_language(l) {
        Some(lang) => Ok(Some(lang)),
        None => Err(E2bError::invalid(format!(
            "language {l:?} is not supported by this server: ember's code interpreter runs {} \
             (each where the sandbox's template has it)",
            ember_runtime::call::LANGUAGES.join(", ")
        ))),
    }
}

// ----- /execute -----

/// The `/execute` request (all four keys are always sent by the SDKs).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ExecuteBody {
    /// The code.
    pub code: String,
    /// A context from `/contexts`.
    pub context_id: Option<String>,
    /// A language's default context.
    pub language: Option<String>,
    /// Environment for this execution only.
    pub env_vars: Option<BTreeMap<String, String>>,
}

/// The E2B `result` line of a MIME bundle.
pub fn result_line(bundle: &Map<String, Value>, is_main: bool) -> Value {
    let mut out = Map::new();
    out.insert("type".into(), json!("result"));
    let mut extra = Map::new();
    for (mime, v) in bundle {
        if v.is_null() {
            continue;
        }
        let key = match mime.as_str() {
            "text/plain" => "text",
            "text/html" => "html",
            "text/markdown" => "markdown",
            "image/svg+xml" => "svg",
            "image/png" => "png",
            "image/jpeg" => "jpeg",
            "application/pdf" => "pdf",
            "text/latex" => "latex",
            "application/json" => "json",
            "application/javascript" => "javascript",
            "e2b/data" => "data",
            "e2b/chart" => "chart",
            _ => {
                extra.insert(mime.clone(), v.clone());
                continue;
            }
        };
        let v = match (key, v) {
            ("text", Value::String(t)) => Value::String(strip_quotes(t).to_string()),
            _ => v.clone(),
        };
        out.insert(key.into(), v);
    }
    out.insert("extra".into(), Value::Object(extra));
    out.insert("is_main_result".into(), json!(is_main));
    Value::Object(out)
}

/// `'x'` or `"x"` → `x`, as E2B's server does with `text/plain` (string reprs).
fn strip_quotes(t: &str) -> &str {
    let b = t.as_bytes();
    if b.len() >= 2 && (b[0] == b'\'' || b[0] == b'"') && b[b.len() - 1] == b[0] {
        &t[1..t.len() - 1]
    } else {
        t
    }
}

/// One NDJSON line (JSON has no raw newlines, so a line is never blank).
fn line(v: &Value) -> Bytes {
    let mut b = serde_json::to_vec(v).unwrap_or_else(|_| b"{\"type\":\"keepalive\"}".to_vec());
    b.push(b'\n');
    Bytes::from(b)
}

/// Text of a byte stream cut at arbitrary points: an incomplete UTF-8 sequence at the end
/// of a chunk waits for the next one.
#[derive(Debug, Default)]
struct Utf8Carry(Vec<u8>);

impl Utf8Carry {
    fn push(&mut self, data: &[u8]) -> String {
        self.0.extend_from_slice(data);
        let valid = match std::str::from_utf8(&self.0) {
            Ok(_) => self.0.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => self.0.len(),
        };
        let rest = self.0.split_off(valid);
        let text = String::from_utf8_lossy(&self.0).into_owned();
        self.0 = rest;
        text
    }
}

/// Translates agent events into E2B lines.
#[derive(Debug, Default)]
pub struct Translator {
    out: Utf8Carry,
    err: Utf8Carry,
    counted: bool,
}

impl Translator {
    /// The lines of one event.
    pub fn lines(&mut self, ev: &EventKind) -> Vec<Value> {
        let now = || ember_runtime::clock::rfc3339(ember_runtime::clock::now_ms());
        let text =
            |kind: &str, text: String| json!({"type": kind, "text": text, "timestamp": now()});
        match ev {
            EventKind::Stdout { data } => {
                let t = self.out.push(data);
                if t.is_empty() {
                    vec![]
                } else {
                    vec![text("stdout", t)]
                }
            }
            EventKind::Stderr { data } => {
                let t = self.err.push(data);
                if t.is_empty() {
                    vec![]
                } else {
                    vec![text("stderr", t)]
                }
            }
            EventKind::Result(r) => {
                let mut v = Vec::new();
                if let Some(n) = r.execution_count {
                    v.extend(self.count(n));
                }
                v.push(result_line(&r.data, true));
                v
            }
            EventKind::Display(d) => vec![result_line(&d.data, false)],
            EventKind::Exception(x) => vec![json!({
                "type": "error",
                "name": x.name,
                "value": x.value,
                "traceback": x.traceback.join("\n"),
            })],
            EventKind::Truncated { limit } => vec![text(
                "stderr",
                format!("[ember: output over {limit} bytes was dropped]\n"),
            )],
            EventKind::ContextRestarted { reason } => vec![text(
                "stderr",
                format!(
                    "[ember: the context's process had ended ({reason}) and was restarted; its \
                     state is lost]\n"
                ),
            )],
            _ => vec![],
        }
    }

    /// `number_of_executions`, once.
    pub fn count(&mut self, n: u64) -> Option<Value> {
        if self.counted {
            return None;
        }
        self.counted = true;
        Some(json!({"type": "number_of_executions", "execution_count": n}))
    }
}

/// What the blocking call sends to the response.
#[derive(Debug)]
enum Msg {
    Line(Bytes),
    /// The call ended: fine (the final lines were sent), or an error.
    Done(Result<(), (RuntimeError, bool)>),
}

/// Cancels the call when dropped armed (the client went away mid-call).
struct Abandon(Option<Box<dyn FnOnce() + Send>>);

impl Drop for Abandon {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            tracing::info!("the client left /execute before the end; cancelling the run");
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn_blocking(f);
            } else {
                std::thread::spawn(f);
            }
        }
    }
}

fn context_error(id: &str, ctx: &str, e: RuntimeError) -> Response {
    match &e {
        RuntimeError::Guest {
            code: ErrorCode::NoSuchContext,
            ..
        } => (StatusCode::NOT_FOUND, format!("Context {ctx} not found")).into_response(),
        _ => gone_or(id, e).into_response(),
    }
}

async fn execute(
    State(st): State<E2bState>,
    Extension(t): Extension<Target>,
    E2bJson(body): E2bJson<ExecuteBody>,
) -> Response {
    if body.context_id.is_some() && body.language.is_some() {
        return E2bError::invalid("give context_id or language, not both").into_response();
    }
    let lang = match language(body.language.as_deref()) {
        Ok(l) => l,
        Err(e) => return e.into_response(),
    };
    // The call's environment; the runtime adds the sandbox's (create's `envVars`) under it.
    let env = body.env_vars.unwrap_or_default();
    // Without a named context, E2B's own default contexts (in the user's home).
    let implicit = body.context_id.is_none();
    let context = body
        .context_id
        .unwrap_or_else(|| e2b_default_context(lang.unwrap_or("python")));
    let req = RunCodeRequest {
        context: Some(context.clone()),
        code: body.code,
        env,
        ..Default::default()
    };
    let (b, id) = (st.backend(), t.id.clone());
    // The client going away cancels the run: its agent connection is closed, which interrupts
    // this run in the guest and no later one.
    let cancel = call::Cancel::new();
    let abandoned = cancel.clone();
    let mut abandon = Abandon(Some(Box::new(move || abandoned.fire())));
    let (tx, mut rx) = mpsc::channel::<Msg>(32);
    let span = Span::current();
    tokio::task::spawn_blocking(move || {
        let _enter = span.enter();
        run(&*b, &id, &req, implicit, &tx, &cancel);
    });
    let first = match tokio::time::timeout(FIRST_WAIT, rx.recv()).await {
        Ok(Some(Msg::Done(Err((e, false))))) => {
            abandon.0 = None;
            return context_error(&t.id, &context, e);
        }
        Ok(m) => m,
        Err(_) => None,
    };
    ndjson_response(first, rx, abandon)
}

/// The context `/execute` runs python in when none is named. E2B's default contexts start in
/// the user's home, where relative `files.*` paths land (the templates' own `default` context
/// starts in `/workspace`); made on first use from one of the template's spare contexts
/// (milliseconds), then kept, and carried by forks and snapshots like any context.
pub const E2B_PYTHON: &str = "e2b-python";
/// The same for bash (and `e2b-javascript`, `e2b-typescript`, `e2b-r`, `e2b-java`: the prefix
/// and the language; see [`e2b_default_context`]).
pub const E2B_BASH: &str = "e2b-bash";
/// The prefix of E2B's per-language default contexts.
const E2B_PREFIX: &str = "e2b-";

/// The default context of a (canonical) language.
pub fn e2b_default_context(language: &str) -> String {
    format!("{E2B_PREFIX}{language}")
}
/// Their working directory.
const E2B_CWD: &str = "/home/user";

/// Makes the named default context `ctx` (see [`E2B_PYTHON`]); one made meanwhile by a
/// concurrent first call is fine.
fn make_default_context(b: &dyn Backend, id: &str, ctx: &str) -> Result<(), RuntimeError> {
    let language = ctx
        .strip_prefix(E2B_PREFIX)
        .and_then(ember_runtime::call::canonical_language)
        .unwrap_or("python");
    let create = call::ContextCreate {
        id: id.to_string(),
        language: language.to_string(),
        cwd: Some(E2B_CWD.to_string()),
        context: Some(ctx.to_string()),
    };
    match b.call(create, Io::none()) {
        Ok(_) => Ok(()),
        Err(RuntimeError::Guest {
            code: ErrorCode::Exists,
            ..
        }) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Runs the code, sending lines; the last message is always `Done`. With `implicit`, the
/// context is one of E2B's defaults, made when missing.
fn run(
    b: &dyn Backend,
    id: &str,
    req: &RunCodeRequest,
    implicit: bool,
    tx: &mpsc::Sender<Msg>,
    cancel: &Arc<call::Cancel>,
) {
    let mut tr = Translator::default();
    let mut sent = false;
    let attempt = |tr: &mut Translator, sent: &mut bool| {
        b.call(
            call::RunCode {
                id: id.to_string(),
                req: req.clone(),
            },
            Io::events(&mut |ev| {
                for v in tr.lines(ev) {
                    if tx.blocking_send(Msg::Line(line(&v))).is_err() {
                        return false;
                    }
                    *sent = true;
                }
                true
            })
            .with_cancel(cancel.clone()),
        )
    };
    let mut r = attempt(&mut tr, &mut sent);
    if let Err(RuntimeError::Guest {
        code: ErrorCode::NoSuchContext,
        ..
    }) = &r
    {
        if implicit && !sent {
            let ctx = req.context.as_deref().unwrap_or(E2B_PYTHON);
            r = match make_default_context(b, id, ctx) {
                Ok(()) => attempt(&mut tr, &mut sent),
                Err(e) => Err(e),
            };
        }
    }
    let done = match r {
        Ok(end) => {
            let mut tail: Vec<Value> = end
                .execution_count
                .and_then(|n| tr.count(n))
                .into_iter()
                .collect();
            tail.push(json!({"type": "end_of_execution"}));
            for v in tail {
                if tx.blocking_send(Msg::Line(line(&v))).is_err() {
                    return;
                }
            }
            Ok(())
        }
        Err(e) => Err((e, sent)),
    };
    let _ = tx.blocking_send(Msg::Done(done));
}

/// The streamed body: lines as they come, `keepalive` when idle, and for a call that failed
/// after its first line an `error` line named `UnexpectedEndOfExecution` then
/// `end_of_execution`.
fn ndjson_response(first: Option<Msg>, rx: mpsc::Receiver<Msg>, abandon: Abandon) -> Response {
    struct S {
        pending: Option<Msg>,
        rx: mpsc::Receiver<Msg>,
        done: bool,
        abandon: Abandon,
    }
    let s = S {
        pending: first,
        rx,
        done: false,
        abandon,
    };
    let stream = futures_util::stream::unfold(s, |mut s| async move {
        if s.done {
            return None;
        }
        let msg = match s.pending.take() {
            Some(m) => Some(m),
            None => match tokio::time::timeout(KEEPALIVE, s.rx.recv()).await {
                Ok(m) => m,
                Err(_) => {
                    let k = line(&json!({"type": "keepalive"}));
                    return Some((Ok::<_, std::io::Error>(k), s));
                }
            },
        };
        match msg {
            Some(Msg::Line(b)) => Some((Ok(b), s)),
            Some(Msg::Done(Ok(()))) => {
                // Over: nothing to interrupt any more.
                s.abandon.0.take();
                None
            }
            other => {
                // Failed (or the task died without a word): say so, then end properly.
                s.abandon.0.take();
                s.done = true;
                let message = match other {
                    Some(Msg::Done(Err((e, _)))) => e.to_string(),
                    _ => "the execution ended without a result".to_string(),
                };
                let mut b = line(&json!({
                    "type": "error",
                    "name": "UnexpectedEndOfExecution",
                    "value": message,
                    "traceback": "",
                }))
                .to_vec();
                b.extend_from_slice(&line(&json!({"type": "end_of_execution"})));
                Some((Ok(Bytes::from(b)), s))
            }
        }
    });
    let mut resp = Response::new(Body::from_stream(stream));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

// ----- /contexts -----

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ContextBody {
    language: Option<String>,
    cwd: Option<String>,
}

fn context_json(c: &ContextInfo) -> Value {
    json!({"id": c.id, "language": c.language, "cwd": c.cwd})
}

async fn create_context(
    State(st): State<E2bState>,
    Extension(t): Extension<Target>,
    E2bJson(body): E2bJson<ContextBody>,
) -> Response {
    let lang = match language(body.language.as_deref()) {
        Ok(l) => l.unwrap_or("python"),
        Err(e) => return e.into_response(),
    };
    let cwd = body.cwd.unwrap_or_else(|| DEFAULT_CWD.to_string());
    let id = t.id.clone();
    match st
        .app
        .call(move |b| {
            b.call(
                call::ContextCreate {
                    id: id.to_string(),
                    language: lang.to_string(),
                    cwd: Some(&cwd).map(|s| s.to_string()),
                    context: None,
                },
                Io::none(),
            )
        })
        .await
    {
        Ok(c) => Json(context_json(&c)).into_response(),
        Err(e) => E2bError::from(e).into_response(),
    }
}

async fn list_contexts(State(st): State<E2bState>, Extension(t): Extension<Target>) -> Response {
    let id = t.id.clone();
    match st
        .app
        .call(move |b| b.call(call::ContextList { id: id.to_string() }, Io::none()))
        .await
    {
        Ok(v) => Json(Value::Array(v.iter().map(context_json).collect())).into_response(),
        Err(e) => E2bError::from(e).into_response(),
    }
}

async fn restart_context(
    State(st): State<E2bState>,
    Extension(t): Extension<Target>,
    super::E2bPath(ctx): super::E2bPath<String>,
) -> Response {
    let (id, c) = (t.id.clone(), ctx.clone());
    let job = st.app.spawn(move |b| {
        b.call(
            call::ContextRestart {
                id: id.to_string(),
                context: c.to_string(),
            },
            Io::none(),
        )
    });
    match job.await {
        Ok(Ok(())) => StatusCode::OK.into_response(),
        Ok(Err(e)) => context_error(&t.id, &ctx, e),
        Err(e) => E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn remove_context(
    State(st): State<E2bState>,
    Extension(t): Extension<Target>,
    super::E2bPath(ctx): super::E2bPath<String>,
) -> Response {
    let (id, c) = (t.id.clone(), ctx.clone());
    let job = st.app.spawn(move |b| {
        b.call(
            call::ContextRemove {
                id: id.to_string(),
                context: c.to_string(),
            },
            Io::none(),
        )
    });
    match job.await {
        Ok(Ok(())) => StatusCode::OK.into_response(),
        Ok(Err(e)) => context_error(&t.id, &ctx, e),
        Err(e) => E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mime_types_map_to_e2b_keys() {
        let bundle: Map<String, Value> = serde_json::from_value(json!({
            "text/plain": "'hi'",
            "text/html": "<b>",
            "image/png": "iVBOR",
            "image/jpeg": "/9j/",
            "image/svg+xml": "<svg/>",
            "text/markdown": "# x",
            "application/json": {"a": 1},
            "text/latex": "$x$",
            "application/pdf": "JVBER",
            "application/javascript": "1",
            "application/vnd.custom": {"z": 2},
            "image/gif": null,
        }))
        .unwrap();
        let v = result_line(&bundle, true);
        assert_eq!(v["type"], "result");
        assert_eq!(v["text"], "hi");
        assert_eq!(v["html"], "<b>");
        assert_eq!(v["png"], "iVBOR");
        assert_eq!(v["jpeg"], "/9j/");
        assert_eq!(v["svg"], "<svg/>");
        assert_eq!(v["markdown"], "# x");
        assert_eq!(v["json"], json!({"a": 1}));
        assert_eq!(v["latex"], "$x$");
        assert_eq!(v["pdf"], "JVBER");
        assert_eq!(v["javascript"], "1");
        assert_eq!(v["extra"], json!({"application/vnd.custom": {"z": 2}}));
        assert_eq!(v["is_main_result"], true);
        assert!(v.get("gif").is_none());
        let v = result_line(&Map::new(), false);
        assert_eq!(v["extra"], json!({}));
        assert_eq!(v["is_main_result"], false);
    }

    #[test]
    fn quotes_are_stripped_only_when_they_match() {
        assert_eq!(strip_quotes("'a'"), "a");
        assert_eq!(strip_quotes("\"a\""), "a");
        assert_eq!(strip_quotes("'a\""), "'a\"");
        assert_eq!(strip_quotes("'"), "'");
        assert_eq!(strip_quotes("2"), "2");
    }

    #[test]
    fn split_utf8_waits_for_the_rest_of_the_character() {
        let mut c = Utf8Carry::default();
        let e = "é".as_bytes();
        assert_eq!(c.push(&[b'a', e[0]]), "a");
        assert_eq!(c.push(&[e[1], b'b']), "éb");
        assert_eq!(c.push(&[0xff]), "\u{fffd}");
    }

    #[test]
    fn languages() {
        assert_eq!(language(None).unwrap(), None);
        assert_eq!(language(Some("Python")).unwrap(), Some("python"));
        assert_eq!(language(Some("bash")).unwrap(), Some("bash"));
        assert_eq!(language(Some("js")).unwrap(), Some("javascript"));
        assert_eq!(language(Some("TypeScript")).unwrap(), Some("typescript"));
        assert_eq!(language(Some("R")).unwrap(), Some("r"));
        assert_eq!(language(Some("java")).unwrap(), Some("java"));
        let e = language(Some("cobol")).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e2b_default_context("r"), "e2b-r");
        assert_eq!(e2b_default_context("python"), E2B_PYTHON);
    }

    #[test]
    fn events_become_e2b_lines() {
        let mut t = Translator::default();
        let out = t.lines(&EventKind::Stdout {
            data: b"hi\n".to_vec(),
        });
        assert_eq!(out[0]["type"], "stdout");
        assert_eq!(out[0]["text"], "hi\n");
        assert!(out[0]["timestamp"].is_string());
        let r = ember_runtime::call::ResultData {
            data: serde_json::from_value(json!({"text/plain": "2"})).unwrap(),
            execution_count: Some(3),
        };
        let out = t.lines(&EventKind::Result(r));
        assert_eq!(
            out[0],
            json!({"type": "number_of_executions", "execution_count": 3})
        );
        assert_eq!(out[1]["text"], "2");
        assert!(t.count(3).is_none());
        let x = ember_runtime::call::Exception {
            name: "ZeroDivisionError".into(),
            value: "division by zero".into(),
            traceback: vec!["a".into(), "b".into()],
        };
        let out = t.lines(&EventKind::Exception(x));
        assert_eq!(
            out[0],
            json!({"type": "error", "name": "ZeroDivisionError", "value": "division by zero",
                   "traceback": "a\nb"})
        );
    }
}

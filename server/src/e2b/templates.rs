//! E2B's template build API (`docs/e2b.md` §10), as the SDKs' `Template.build(...)` calls it:
//!
//! 1. `POST /v3/templates` `{name, tags, cpuCount, memoryMB}` → a template id and a build id;
//! 2. for each `COPY`: `GET /templates/{id}/files/{hash}` → `{present}` or an upload `url`,
//!    which the SDK `PUT`s a tar (gzip) of the files to (the URL carries a token derived from
//!    the server's: the SDK sends no API key there);
//! 3. `POST /v2/templates/{id}/builds/{buildID}` with the steps (`fromImage`/`fromTemplate`,
//!    `steps` of `RUN`, `COPY`, `ENV`, `WORKDIR`, `USER`, `startCmd`, `readyCmd`);
//! 4. `GET /templates/{id}/builds/{buildID}/status?logsOffset=N`, polled until `ready` or
//!    `error`, with the build's log lines.
//!
//! The steps go to the same executor as `ember template build --dockerfile`
//! ([`ember_runtime::template::steps`]): they run in a build VM, each cached by its inputs,
//! and the result is a template named as the build (`Sandbox.create("name")` uses it at
//! once). Uploaded tars are unpacked with the OCI unpacker (no path leaves its directory),
//! one directory per content hash. Also: `GET /templates` (list), `GET
//! /templates/aliases/{alias}`, tags (`POST`/`DELETE /templates/tags`, `GET
//! /templates/{id}/tags`), and `DELETE /templates/{id}` removes a template built here.
//!
//! Builds run on the serving host. `RUN` has no network unless the server was started with
//! `EMBER_BUILD_NETNS` naming a network namespace (docs/images.md).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex};

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::StreamExt;

use super::{E2bError, E2bJson, E2bPath, E2bState};
use ember_runtime::template::dockerfile::{Command, From, Step};
use ember_runtime::template::{BuildEvent, StepsSpec, Template};

type Answer<T> = Result<T, E2bError>;

/// Largest upload (one COPY's tar).
const MAX_UPLOAD: u64 = 4 << 30;

/// A template made through this API.
#[derive(Debug, Clone)]
struct Tpl {
    name: String,
    tags: Vec<String>,
    builds: Vec<String>,
    created: String,
}

/// One build.
#[derive(Debug, Clone)]
struct Build {
    template_id: String,
    status: &'static str,
    logs: Vec<(String, &'static str, String)>,
    reason: Option<String>,
}

#[derive(Debug, Default)]
struct Registry {
    templates: BTreeMap<String, Tpl>,
    builds: BTreeMap<String, Build>,
}

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(Default::default);

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

fn now() -> String {
    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string()
}

/// A build id in the UUID shape the SDKs parse (random, version 4 bits set).
fn build_uuid() -> String {
    let h = format!(
        "{}{}",
        ember_runtime::paths::random_id(),
        ember_runtime::paths::random_id()
    );
    format!(
        "{}-{}-4{}-a{}-{}",
        &h[0..8],
        &h[8..12],
        &h[13..16],
        &h[17..20],
        &h[20..32]
    )
}

fn files_dir() -> PathBuf {
    ember_runtime::paths::cache_dir().join("e2b-files")
}

fn is_hash(h: &str) -> bool {
    h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The upload token of a files hash (derived from the server's token).
fn upload_token(st: &E2bState, hash: &str) -> String {
    crate::tokens::derive_token(&st.app.inner.token, "e2b-template-upload", hash)
}

/// Whether `uri` is an upload URL this server handed out (its token is the API key there).
pub fn upload_token_ok(st: &E2bState, method: &axum::http::Method, uri: &Uri) -> bool {
    if method != axum::http::Method::PUT {
        return false;
    }
    let Some(hash) = upload_hash(uri.path()) else {
        return false;
    };
    let token = uri
        .query()
        .unwrap_or_default()
        .split('&')
        .find_map(|kv| kv.strip_prefix("token="))
        .unwrap_or_default();
    crate::same(token.as_bytes(), upload_token(st, hash).as_bytes())
}

/// `/templates/{id}/files/{hash}` → the hash.
fn upload_hash(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/templates/")?;
    let mut parts = rest.split('/');
    let (_id, files, hash) = (parts.next()?, parts.next()?, parts.next()?);
    (files == "files" && parts.next().is_none() && is_hash(hash)).then_some(hash)
}

/// A name as E2B gives it (`name` or `name:tag`): the template name and the tag.
fn split_name(full: &str) -> Answer<(String, Option<String>)> {
    let (name, tag) = match full.split_once(':') {
        Some((n, t)) => (n.to_string(), Some(t.to_string())),
        None => (full.to_string(), None),
    };
    ember_runtime::template::check_name(&name).map_err(|e| E2bError::invalid(e.to_string()))?;
    Ok((name, tag))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct NewTemplate {
    name: Option<String>,
    alias: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
}

/// `POST /v3/templates`.
pub(super) async fn create(E2bJson(body): E2bJson<NewTemplate>) -> Answer<Response> {
    let full = body
        .name
        .or(body.alias)
        .ok_or_else(|| E2bError::invalid("the template needs a name"))?;
    let (name, tag) = split_name(&full)?;
    let build_id = build_uuid();
    let mut reg = registry();
    // A template is its name: building the same name again is a new build of it.
    let id = name.clone();
    let t = reg.templates.entry(id.clone()).or_insert_with(|| Tpl {
        name: name.clone(),
        tags: Vec::new(),
        builds: Vec::new(),
        created: now(),
    });
    t.builds.push(build_id.clone());
    for tg in tag.iter().chain(body.tags.iter()) {
        if !t.tags.contains(tg) {
            t.tags.push(tg.clone());
        }
    }
    let tags = t.tags.clone();
    reg.builds.insert(
        build_id.clone(),
        Build {
            template_id: id.clone(),
            status: "waiting",
            logs: Vec::new(),
            reason: None,
        },
    );
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({
            "templateID": id, "buildID": build_id, "public": false,
            "names": [name], "aliases": [name], "tags": tags,
        })),
    )
        .into_response())
}

/// `GET /templates/{id}/files/{hash}`: whether the files are here, else where to put them.
pub(super) async fn file_link(
    State(st): State<E2bState>,
    headers: HeaderMap,
    E2bPath((id, hash)): E2bPath<(String, String)>,
) -> Answer<Response> {
    if !is_hash(&hash) {
        return Err(E2bError::invalid(format!(
            "files hash {hash:?} is not a SHA-256"
        )));
    }
    // 201, as E2B's API answers (the SDKs parse no other status).
    if files_dir().join(format!("{hash}.tar")).is_file() {
        return Ok((StatusCode::CREATED, Json(json!({"present": true}))).into_response());
    }
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1");
    let url = format!(
        "http://{host}/templates/{id}/files/{hash}?token={}",
        upload_token(&st, &hash)
    );
    Ok((
        StatusCode::CREATED,
        Json(json!({"present": false, "url": url})),
    )
        .into_response())
}

/// `PUT /templates/{id}/files/{hash}?token=…`: the files (a tar, gzip or not).
pub(super) async fn upload(
    E2bPath((_id, hash)): E2bPath<(String, String)>,
    body: Body,
) -> Answer<StatusCode> {
    if !is_hash(&hash) {
        return Err(E2bError::invalid("not a files hash"));
    }
    let dir = files_dir();
    std::fs::create_dir_all(&dir)
        .map_err(|e| E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let tmp = tempfile::NamedTempFile::new_in(&dir)
        .map_err(|e| E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let mut stream = body.into_data_stream();
    let mut n = 0u64;
    {
        use std::io::Write;
        let mut f = tmp.as_file();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| E2bError::invalid(format!("the upload broke: {e}")))?;
            n += chunk.len() as u64;
            if n > MAX_UPLOAD {
                return Err(E2bError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("an upload is at most {MAX_UPLOAD} bytes"),
                ));
            }
            f.write_all(&chunk)
                .map_err(|e| E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        }
    }
    tmp.persist(dir.join(format!("{hash}.tar")))
        .map_err(|e| E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok(StatusCode::OK)
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct StartBuild {
    from_image: Option<String>,
    from_template: Option<String>,
    #[serde(default)]
    steps: Vec<E2bStep>,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
    #[serde(default)]
    force: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct E2bStep {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    args: Vec<String>,
    files_hash: Option<String>,
}

/// The SDK's steps as the executor's. `COPY` sources become `<step>/<src>` in `context`,
/// where each COPY's files are unpacked.
fn to_steps(body: &StartBuild, context: &Path) -> Result<(From, Vec<(usize, Step)>), String> {
    let from = match (&body.from_image, &body.from_template) {
        // A Dockerfile's `FROM template:NAME` reaches here as an image.
        (Some(i), None) if i.starts_with("template:") => {
            From::Template(i["template:".len()..].to_string())
        }
        (Some(i), None) if !i.is_empty() => From::Image(i.clone()),
        (None, Some(t)) if !t.is_empty() => From::Template(t.clone()),
        _ => return Err("exactly one of fromImage and fromTemplate must be given".into()),
    };
    let mut steps = Vec::new();
    let mut user = "root".to_string();
    for (i, s) in body.steps.iter().enumerate() {
        let n = i + 1;
        let arg = |k: usize| s.args.get(k).cloned().unwrap_or_default();
        match s.kind.as_str() {
            "RUN" => {
                let as_user = arg(1);
                if !as_user.is_empty() && as_user != user {
                    steps.push((n, Step::User(as_user.clone())));
                    steps.push((n, Step::Run(Command::Shell(arg(0)))));
                    steps.push((n, Step::User(user.clone())));
                } else {
                    steps.push((n, Step::Run(Command::Shell(arg(0)))));
                }
            }
            "ENV" => {
                let pairs: Vec<(String, String)> = s
                    .args
                    .chunks(2)
                    .map(|c| (c[0].clone(), c.get(1).cloned().unwrap_or_default()))
                    .collect();
                steps.push((n, Step::Env(pairs)));
            }
            "WORKDIR" => steps.push((n, Step::Workdir(arg(0)))),
            "USER" => {
                user = arg(0);
                steps.push((n, Step::User(user.clone())));
            }
            "COPY" => {
                let hash = s
                    .files_hash
                    .clone()
                    .filter(|h| is_hash(h))
                    .ok_or_else(|| format!("step {n}: COPY without a files hash"))?;
                let src = arg(0);
                if src.contains(['*', '?', '[']) {
                    return Err(format!(
                        "step {n}: COPY of the pattern {src:?} is not supported: name files or \
                         a directory"
                    ));
                }
                let src = ember_runtime::template::dockerfile::normalize_source(&src)
                    .ok_or_else(|| format!("step {n}: COPY source {src:?} leaves the context"))?;
                let dir = format!("{hash}-{n}");
                unpack_files(&hash, &context.join(&dir))?;
                let mode = arg(3);
                let chmod = if mode.is_empty() {
                    None
                } else {
                    Some(
                        u32::from_str_radix(&mode, 8)
                            .map_err(|_| format!("step {n}: COPY mode {mode:?} is not octal"))?,
                    )
                };
                steps.push((
                    n,
                    Step::Copy {
                        sources: vec![format!("{dir}/{src}")],
                        dest: arg(1),
                        chmod,
                    },
                ));
            }
            other => return Err(format!("step {n}: unknown step type {other:?}")),
        }
    }
    if let Some(cmd) = &body.start_cmd {
        steps.push((
            body.steps.len() + 1,
            Step::Entrypoint(Command::Shell(cmd.clone())),
        ));
    }
    Ok((from, steps))
}

/// Unpacks the uploaded files `hash` into `dest` (hardened: nothing leaves `dest`).
fn unpack_files(hash: &str, dest: &Path) -> Result<(), String> {
    let tar = files_dir().join(format!("{hash}.tar"));
    let f = std::fs::File::open(&tar).map_err(|e| {
        format!(
            "the files {hash} were not uploaded ({}: {e})",
            tar.display()
        )
    })?;
    std::fs::create_dir_all(dest).map_err(|e| format!("{}: {e}", dest.display()))?;
    let limits = ember_oci::unpack::Limits {
        owners: false,
        ..ember_oci::unpack::Limits::default()
    };
    let mut u = ember_oci::unpack::Unpacker::open(dest, limits).map_err(|e| e.to_string())?;
    u.layer(hash, f, None).map_err(|e| e.to_string())
}

/// `POST /v2/templates/{id}/builds/{buildID}`: starts the build in the background.
pub(super) async fn start(
    State(st): State<E2bState>,
    E2bPath((id, build_id)): E2bPath<(String, String)>,
    E2bJson(body): E2bJson<StartBuild>,
) -> Answer<StatusCode> {
    let name = {
        let mut reg = registry();
        let name = reg
            .templates
            .get(&id)
            .map(|t| t.name.clone())
            .ok_or_else(|| E2bError::not_found(format!("template {id} does not exist")))?;
        let b = reg
            .builds
            .get_mut(&build_id)
            .filter(|b| b.template_id == id)
            .ok_or_else(|| E2bError::not_found(format!("build {build_id} does not exist")))?;
        if b.status != "waiting" {
            return Err(E2bError::new(
                StatusCode::CONFLICT,
                format!("build {build_id} was already started"),
            ));
        }
        b.status = "building";
        name
    };
    let base_alias = st
        .opts
        .aliases
        .get("base")
        .cloned()
        .unwrap_or_else(|| "base".into());
    std::thread::Builder::new()
        .name(format!("e2b-build-{build_id}"))
        .spawn(move || run_build(&name, &build_id, body, &base_alias))
        .map_err(|e| E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok(StatusCode::ACCEPTED)
}

fn log(build_id: &str, level: &'static str, message: String) {
    if let Some(b) = registry().builds.get_mut(build_id) {
        b.logs.push((now(), level, message));
    }
}

fn run_build(name: &str, build_id: &str, body: StartBuild, base_alias: &str) {
    let work = ember_runtime::paths::cache_dir()
        .join("e2b-builds")
        .join(build_id);
    let result = (|| -> Result<Template, String> {
        let (mut from, steps) = to_steps(&body, &work.join("context"))?;
        // E2B's own base template is the server's (`base` → `default`).
        if from == From::Template("base".into()) {
            from = From::Template(base_alias.to_string());
        }
        let mut spec = StepsSpec::new(from, steps);
        spec.context = Some(work.join("context"));
        spec.netns = std::env::var("EMBER_BUILD_NETNS")
            .ok()
            .filter(|s| !s.is_empty());
        spec.code_optional = true;
        spec.start = body.start_cmd.is_some();
        spec.start_ready = body
            .ready_cmd
            .as_ref()
            .map(|r| vec!["/bin/sh".into(), "-c".into(), r.clone()]);
        spec.rebuild = body.force;
        ember_runtime::template::build_from_steps(name, &spec, &mut |ev| match ev {
            BuildEvent::Step(s) => log(build_id, "info", s),
            BuildEvent::Output(s) => {
                for l in s.lines() {
                    log(build_id, "info", l.to_string());
                }
            }
            BuildEvent::UpToDate => log(build_id, "info", "the template is up to date".into()),
        })
        .map_err(|e| e.to_string())
    })();
    let _ = std::fs::remove_dir_all(&work);
    let mut reg = registry();
    if let Some(b) = reg.builds.get_mut(build_id) {
        match result {
            Ok(t) => {
                b.logs.push((
                    now(),
                    "info",
                    format!("template {name} built ({})", &t.info.key[..12]),
                ));
                b.status = "ready";
            }
            Err(e) => {
                b.logs.push((now(), "error", e.clone()));
                b.reason = Some(e);
                b.status = "error";
            }
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct StatusQuery {
    logs_offset: Option<usize>,
    limit: Option<usize>,
}

/// `GET /templates/{id}/builds/{buildID}/status`.
pub(super) async fn status(
    E2bPath((id, build_id)): E2bPath<(String, String)>,
    Query(q): Query<StatusQuery>,
) -> Answer<Json<Value>> {
    let reg = registry();
    let b = reg
        .builds
        .get(&build_id)
        .filter(|b| b.template_id == id)
        .ok_or_else(|| E2bError::not_found(format!("build {build_id} does not exist")))?;
    let from = q.logs_offset.unwrap_or(0).min(b.logs.len());
    let to = (from + q.limit.unwrap_or(100).clamp(1, 100)).min(b.logs.len());
    let entries: Vec<Value> = b.logs[from..to]
        .iter()
        .map(|(ts, level, msg)| json!({"timestamp": ts, "level": level, "message": msg}))
        .collect();
    let logs: Vec<String> = b.logs[from..to]
        .iter()
        .map(|(ts, _, m)| format!("[{ts}] {m}"))
        .collect();
    let mut out = json!({
        "templateID": id, "buildID": build_id, "status": b.status,
        "logEntries": entries, "logs": logs,
    });
    if let Some(r) = &b.reason {
        out["reason"] = json!({"message": r});
    }
    Ok(Json(out))
}

/// `GET /templates`: the templates built here and the server's own.
pub(super) async fn list() -> Answer<Json<Value>> {
    let built = registry().templates.clone();
    let all = tokio::task::spawn_blocking(Template::list)
        .await
        .map_err(|e| E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let mut out = Vec::new();
    for (name, t) in all {
        let Some(name) = name else { continue };
        let tpl = built.get(&name);
        out.push(json!({
            "templateID": name,
            "buildID": tpl.and_then(|x| x.builds.last().cloned()).unwrap_or_else(|| t.info.key[..12].to_string()),
            "cpuCount": t.info.vm.vcpus,
            "memoryMB": t.info.vm.memory_mib,
            "diskSizeMB": 0,
            "public": false,
            "aliases": [name],
            "names": [name],
            "createdAt": tpl.map(|x| x.created.clone()).unwrap_or_else(|| t.info.built_at.clone()),
            "updatedAt": t.info.built_at,
            "createdBy": null,
            "lastSpawnedAt": null,
            "spawnCount": 0,
            "buildCount": tpl.map(|x| x.builds.len()).unwrap_or(1),
            "envdVersion": super::ENVD_VERSION,
            "buildStatus": "ready",
        }));
    }
    Ok(Json(Value::Array(out)))
}

/// `GET /templates/aliases/{alias}`.
pub(super) async fn alias(E2bPath(alias): E2bPath<String>) -> Answer<Json<Value>> {
    let (name, _) = split_name(&alias)?;
    let n = name.clone();
    let found = tokio::task::spawn_blocking(move || Template::open(&n).is_ok())
        .await
        .unwrap_or(false);
    if !found && !registry().templates.contains_key(&name) {
        return Err(E2bError::not_found(format!("no template is named {alias}")));
    }
    Ok(Json(json!({"templateID": name, "public": false})))
}

/// Whether `id` was made through this API (`DELETE /templates/{id}` removes it then).
pub fn is_built_here(id: &str) -> bool {
    registry().templates.contains_key(id)
}

/// `DELETE /templates/{id}` of a template built here.
pub(super) async fn delete(id: String) -> Answer<StatusCode> {
    registry().templates.remove(&id);
    let n = id.clone();
    tokio::task::spawn_blocking(move || Template::remove(&n))
        .await
        .map_err(|e| E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| E2bError::not_found(e.to_string()))?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
pub(super) struct TagsRequest {
    target: Option<String>,
    name: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
}

/// `POST /templates/tags`: tags on a template (`target` is `name:tag` of a build).
pub(super) async fn add_tags(E2bJson(body): E2bJson<TagsRequest>) -> Answer<Response> {
    let target = body
        .target
        .or(body.name)
        .ok_or_else(|| E2bError::invalid("tags need a target"))?;
    let (name, _) = split_name(&target)?;
    let mut reg = registry();
    let t = reg
        .templates
        .get_mut(&name)
        .ok_or_else(|| E2bError::not_found(format!("template {name} was not built here")))?;
    for tg in &body.tags {
        if !t.tags.contains(tg) {
            t.tags.push(tg.clone());
        }
    }
    let build = t.builds.last().cloned().unwrap_or_default();
    Ok((
        StatusCode::CREATED,
        Json(json!({"buildID": build, "tags": body.tags})),
    )
        .into_response())
}

/// `DELETE /templates/tags`.
pub(super) async fn remove_tags(E2bJson(body): E2bJson<TagsRequest>) -> Answer<StatusCode> {
    let target = body
        .name
        .or(body.target)
        .ok_or_else(|| E2bError::invalid("tags need a name"))?;
    let (name, _) = split_name(&target)?;
    let mut reg = registry();
    let t = reg
        .templates
        .get_mut(&name)
        .ok_or_else(|| E2bError::not_found(format!("template {name} was not built here")))?;
    t.tags.retain(|x| !body.tags.contains(x));
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /templates/{id}/tags`.
pub(super) async fn tags(E2bPath(id): E2bPath<String>) -> Answer<Json<Value>> {
    let reg = registry();
    let t = reg
        .templates
        .get(&id)
        .ok_or_else(|| E2bError::not_found(format!("template {id} was not built here")))?;
    let build = t.builds.last().cloned().unwrap_or_default();
    let out: Vec<Value> = t
        .tags
        .iter()
        .map(|tg| json!({"tag": tg, "buildID": build, "createdAt": t.created}))
        .collect();
    Ok(Json(Value::Array(out)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(v: Value) -> StartBuild {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn sdk_steps_map_onto_the_executor() {
        let d = tempfile::tempdir().unwrap();
        let b = start(json!({
            "fromImage": "python:3.12",
            "steps": [
                {"type": "ENV", "args": ["A", "1", "B", "two"]},
                {"type": "WORKDIR", "args": ["/app"]},
                {"type": "RUN", "args": ["pip install x", "root"]},
                {"type": "USER", "args": ["user"]},
                {"type": "RUN", "args": ["echo hi", "root"]},
            ],
            "startCmd": "python3 -m http.server",
        }));
        let (from, steps) = to_steps(&b, d.path()).unwrap();
        assert_eq!(from, From::Image("python:3.12".into()));
        let s: Vec<Step> = steps.into_iter().map(|(_, s)| s).collect();
        assert_eq!(
            s,
            vec![
                Step::Env(vec![("A".into(), "1".into()), ("B".into(), "two".into())]),
                Step::Workdir("/app".into()),
                Step::Run(Command::Shell("pip install x".into())),
                Step::User("user".into()),
                Step::User("root".into()),
                Step::Run(Command::Shell("echo hi".into())),
                Step::User("user".into()),
                Step::Entrypoint(Command::Shell("python3 -m http.server".into())),
            ]
        );
        for (v, want) in [
            (json!({"steps": []}), "exactly one of"),
            (
                json!({"fromImage": "x", "steps": [{"type": "NOPE"}]}),
                "unknown step type",
            ),
            (
                json!({"fromImage": "x", "steps": [{"type": "COPY", "args": ["a", "/b"]}]}),
                "without a files hash",
            ),
            (
                json!({"fromImage": "x", "steps": [{"type": "COPY", "args": ["../a", "/b"], "filesHash": "a".repeat(64)}]}),
                "leaves the context",
            ),
            (
                json!({"fromImage": "x", "steps": [{"type": "COPY", "args": ["*.py", "/b"], "filesHash": "a".repeat(64)}]}),
                "pattern",
            ),
        ] {
            let e = to_steps(&start(v), d.path()).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn upload_urls_are_recognised_by_path() {
        let h = "ab".repeat(32);
        assert_eq!(
            upload_hash(&format!("/templates/t/files/{h}")),
            Some(h.as_str())
        );
        assert_eq!(upload_hash(&format!("/templates/t/files/{h}/x")), None);
        assert_eq!(upload_hash("/templates/t/files/short"), None);
        assert_eq!(upload_hash(&format!("/sandboxes/t/files/{h}")), None);
    }

    #[test]
    fn build_ids_are_uuids() {
        let u = build_uuid();
        let parts: Vec<usize> = u.split('-').map(str::len).collect();
        assert_eq!(parts, vec![8, 4, 4, 4, 12], "{u}");
        assert!(u.chars().all(|c| c == '-' || c.is_ascii_hexdigit()));
    }

    #[test]
    fn names_and_tags() {
        assert_eq!(
            split_name("my-env:v1").unwrap(),
            ("my-env".into(), Some("v1".into()))
        );
        assert!(split_name("../x").is_err());
    }
}

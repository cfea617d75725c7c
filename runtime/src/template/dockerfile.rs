//! Dockerfiles: parsed into the build steps that [`super::steps`] runs inside an ember VM
//! (docs/images.md, "Dockerfiles").
//!
//! [`parse`] reads the text — comments, line continuations, parser directives, `ARG`
//! substitution (`$X`, `${X}`, `${X:-default}`, `${X:+alt}`) — into one [`Dockerfile`]: its
//! `FROM` and a list of [`Step`]s. What ember cannot do faithfully is refused with the line
//! and the reason (a second `FROM` — multi-stage builds —, `COPY --from`, `ADD` of a URL or an
//! archive, heredocs, `ONBUILD`, an escape character other than `\`), never half-done.
//! [`DockerIgnore`] is the context's `.dockerignore`.

use std::collections::BTreeMap;

/// A Dockerfile that ember refuses: the line (1-based) and the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DockerfileError {
    /// A line that cannot be read as an instruction.
    #[error("Dockerfile line {line}: {message}")]
    Syntax {
        /// The instruction's first line.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// An instruction Docker has and ember does not.
    #[error("Dockerfile line {line}: unknown instruction {word:?}")]
    Unknown {
        /// The instruction's first line.
        line: usize,
        /// The word.
        word: String,
    },
    /// An instruction (or form of one) ember does not support.
    #[error("Dockerfile line {line}: {what} is not supported: {hint}")]
    Unsupported {
        /// The instruction's first line.
        line: usize,
        /// What.
        what: String,
        /// What to do instead.
        hint: String,
    },
    /// No `FROM`.
    #[error("the Dockerfile has no FROM instruction")]
    NoFrom,
    /// A `COPY`/`ADD` source or destination that leaves its tree.
    #[error("Dockerfile line {line}: {which} path {path:?} leaves the {tree}")]
    Traversal {
        /// The instruction's first line.
        line: usize,
        /// `source` or `destination`.
        which: &'static str,
        /// The path.
        path: String,
        /// `build context` or `image root`.
        tree: &'static str,
    },
}

/// What the build starts from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum From {
    /// An OCI/Docker image reference (as `--from-image`).
    Image(String),
    /// Another ember template (`FROM template:NAME`).
    Template(String),
}

/// How a `RUN`, `CMD` or `ENTRYPOINT` was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `RUN apt-get ...`: run by the shell (`SHELL`, default `/bin/sh -c`).
    Shell(String),
    /// `RUN ["prog", "arg"]`: run as is.
    Exec(Vec<String>),
}

impl Command {
    /// The argv: exec form as is, shell form through `shell`.
    pub fn argv(&self, shell: &[String]) -> Vec<String> {
        match self {
            Command::Exec(v) => v.clone(),
            Command::Shell(s) => {
                let mut v = shell.to_vec();
                v.push(s.clone());
                v
            }
        }
    }
}

/// One build step, with `ARG`s substituted where Docker substitutes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Run a command in the image.
    Run(Command),
    /// Copy context paths (relative, checked) to a destination in the image (absolute or
    /// relative to the working directory). `ADD` of local files is the same.
    Copy {
        /// Sources, relative to the context, normalised (no `..`, no leading `/`).
        sources: Vec<String>,
        /// Destination as written (a trailing `/` means a directory).
        dest: String,
        /// `--chmod` (octal), if given.
        chmod: Option<u32>,
    },
    /// Set environment variables (for later steps and the sandbox).
    Env(Vec<(String, String)>),
    /// Working directory (created).
    Workdir(String),
    /// The user later steps (and the sandbox's processes) run as.
    User(String),
    /// The start command.
    Cmd(Command),
    /// The entrypoint.
    Entrypoint(Command),
    /// The shell for shell-form commands.
    Shell(Vec<String>),
}

/// A parsed Dockerfile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dockerfile {
    /// The base.
    pub from: From,
    /// The steps, each with its first line number.
    pub steps: Vec<(usize, Step)>,
    /// The `ARG` values in effect for `RUN` steps (name → value), in declaration order of
    /// their step index: `args[i]` are those declared before step `i`. Flattened here: every
    /// ARG declared after `FROM` with its value, passed to later `RUN`s as environment.
    pub run_args: Vec<(usize, String, String)>,
    /// Notes about ignored instructions (`EXPOSE`, `LABEL`, ...), to show the user.
    pub notes: Vec<String>,
}

/// Instructions ember reads and ignores (metadata with no meaning for a sandbox template).
const IGNORED: &[&str] = &[
    "LABEL",
    "MAINTAINER",
    "EXPOSE",
    "STOPSIGNAL",
    "HEALTHCHECK",
    "VOLUME",
];

/// Parses `text`; `build_args` are `--build-arg` values (they override `ARG` defaults, and
/// only declared `ARG`s are used, as in Docker).
pub fn parse(
    text: &str,
    build_args: &BTreeMap<String, String>,
) -> Result<Dockerfile, DockerfileError> {
    let lines = logical_lines(text)?;
    let mut from: Option<From> = None;
    let mut steps = Vec::new();
    let mut notes = Vec::new();
    // ARGs in scope: before FROM (global, usable in FROM only) and after.
    let mut global: BTreeMap<String, String> = BTreeMap::new();
    let mut args: BTreeMap<String, String> = BTreeMap::new();
    // ENV set so far (substituted in later instructions like ARGs).
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    let mut run_args = Vec::new();
    for (line, text) in lines {
        let (word, rest) = match text.split_once(|c: char| c.is_whitespace()) {
            Some((w, r)) => (w, r.trim()),
            None => (text.as_str(), ""),
        };
        let upper = word.to_ascii_uppercase();
        let syntax = |message: String| DockerfileError::Syntax { line, message };
        let unsupported = |what: &str, hint: &str| DockerfileError::Unsupported {
            line,
            what: what.into(),
            hint: hint.into(),
        };
        if rest.starts_with("<<") || rest.contains(" <<") && upper == "RUN" {
            return Err(unsupported(
                "a heredoc",
                "write the script to a file in the context and COPY it, or use one RUN line",
            ));
        }
        let mut scope = args.clone();
        scope.extend(env.clone());
        let subst = |s: &str, scope: &BTreeMap<String, String>| {
            substitute(s, scope).map_err(|m| syntax(m.to_string()))
        };
        if upper != "FROM" && upper != "ARG" && from.is_none() {
            return Err(syntax(format!(
                "{upper} before FROM (only ARG may come before FROM)"
            )));
        }
        match upper.as_str() {
            "FROM" => {
                if from.is_some() {
                    return Err(unsupported(
                        "a second FROM (a multi-stage build)",
                        "ember builds single-stage Dockerfiles: build the earlier stage as its \
                         own template and start from it with `FROM template:NAME`",
                    ));
                }
                let words: Vec<&str> = rest.split_whitespace().collect();
                let words: Vec<&str> = words
                    .into_iter()
                    .filter(|w| !w.starts_with("--platform"))
                    .collect();
                let reference = match words.as_slice() {
                    [r] => subst(r, &global)?,
                    [r, as_, _] if as_.eq_ignore_ascii_case("as") => subst(r, &global)?,
                    _ => {
                        return Err(syntax(format!(
                            "FROM takes an image reference, not {rest:?}"
                        )))
                    }
                };
                if reference.is_empty() {
                    return Err(syntax("FROM names no image".into()));
                }
                if reference == "scratch" {
                    return Err(unsupported(
                        "FROM scratch",
                        "start from an image with a shell (RUN needs one), e.g. busybox",
                    ));
                }
                from = Some(match reference.strip_prefix("template:") {
                    Some(t) => From::Template(t.to_string()),
                    None => From::Image(reference),
                });
            }
            "ARG" => {
                for (k, v) in split_assignments(rest, false).map_err(syntax)? {
                    if !valid_name(&k) {
                        return Err(syntax(format!("ARG name {k:?} is not valid")));
                    }
                    let value = match build_args.get(&k) {
                        Some(given) => Some(given.clone()),
                        None => match v {
                            Some(d) => Some(subst(&d, &scope)?),
                            // A global ARG redeclared after FROM takes the global value.
                            None => global.get(&k).cloned(),
                        },
                    };
                    if from.is_none() {
                        global.insert(k, value.unwrap_or_default());
                    } else if let Some(v) = value {
                        run_args.push((steps.len(), k.clone(), v.clone()));
                        args.insert(k, v);
                    }
                }
            }
            "RUN" => {
                let cmd = command(rest, line)?;
                // ARGs reach RUN as environment (the shell expands them); nothing to
                // substitute in the text itself.
                steps.push((line, Step::Run(cmd)));
            }
            "CMD" | "ENTRYPOINT" => {
                let cmd = command(rest, line)?;
                steps.push((
                    line,
                    if upper == "CMD" {
                        Step::Cmd(cmd)
                    } else {
                        Step::Entrypoint(cmd)
                    },
                ));
            }
            "SHELL" => match command(rest, line)? {
                Command::Exec(v) if !v.is_empty() => steps.push((line, Step::Shell(v))),
                _ => {
                    return Err(syntax(
                        "SHELL takes a JSON array, e.g. [\"/bin/bash\", \"-c\"]".into(),
                    ))
                }
            },
            "ENV" => {
                let pairs = split_assignments(rest, true).map_err(syntax)?;
                let mut out = Vec::new();
                for (k, v) in pairs {
                    if !valid_name(&k) {
                        return Err(syntax(format!("ENV name {k:?} is not valid")));
                    }
                    let v = subst(&v.unwrap_or_default(), &scope)?;
                    env.insert(k.clone(), v.clone());
                    out.push((k, v));
                }
                if out.is_empty() {
                    return Err(syntax("ENV sets nothing".into()));
                }
                steps.push((line, Step::Env(out)));
            }
            "WORKDIR" => {
                let dir = subst(rest, &scope)?;
                if dir.is_empty() {
                    return Err(syntax("WORKDIR names no directory".into()));
                }
                steps.push((line, Step::Workdir(dir)));
            }
            "USER" => {
                let user = subst(rest, &scope)?;
                if user.is_empty() || user.contains(char::is_whitespace) {
                    return Err(syntax(format!("USER takes one user, not {rest:?}")));
                }
                steps.push((line, Step::User(user)));
            }
            "COPY" | "ADD" => {
                let is_add = upper == "ADD";
                let (flags, paths) = copy_parts(rest).map_err(syntax)?;
                let mut chmod = None;
                for f in flags {
                    if let Some(v) = f.strip_prefix("--chmod=") {
                        chmod =
                            Some(u32::from_str_radix(v, 8).map_err(|_| {
                                syntax(format!("--chmod={v} is not an octal mode"))
                            })?);
                    } else if f.starts_with("--from") {
                        return Err(unsupported(
                            "COPY --from (a multi-stage build)",
                            "build the other stage as its own template, or copy from the context",
                        ));
                    } else {
                        return Err(unsupported(
                            &format!("{upper} option {f}"),
                            "ember's COPY takes --chmod only; files are owned by root (chown \
                             them in a RUN step)",
                        ));
                    }
                }
                let mut paths: Vec<String> = paths
                    .iter()
                    .map(|p| subst(p, &scope))
                    .collect::<Result<_, _>>()?;
                if paths.len() < 2 {
                    return Err(syntax(format!(
                        "{upper} needs at least one source and a destination"
                    )));
                }
                let dest = paths.pop().unwrap_or_default();
                if dest.split('/').any(|c| c == "..") {
                    return Err(DockerfileError::Traversal {
                        line,
                        which: "destination",
                        path: dest,
                        tree: "image root",
                    });
                }
                let mut sources = Vec::new();
                for s in paths {
                    if is_add && (s.contains("://") || s.starts_with("git@")) {
                        return Err(unsupported(
                            "ADD of a URL",
                            "download it in a RUN step (under the build's network policy)",
                        ));
                    }
                    if is_add && is_archive(&s) {
                        return Err(unsupported(
                            "ADD of a local archive (Docker extracts it)",
                            "COPY the archive and extract it in a RUN step",
                        ));
                    }
                    if s.contains(['*', '?', '[']) {
                        return Err(unsupported(
                            &format!("the wildcard source {s:?}"),
                            "name the files or their directory",
                        ));
                    }
                    let n = normalize_source(&s).ok_or(DockerfileError::Traversal {
                        line,
                        which: "source",
                        path: s.clone(),
                        tree: "build context",
                    })?;
                    sources.push(n);
                }
                if sources.len() > 1 && !dest.ends_with('/') {
                    return Err(syntax(format!(
                        "{upper} with several sources needs a destination directory ending in \
                         '/', not {dest:?}"
                    )));
                }
                steps.push((
                    line,
                    Step::Copy {
                        sources,
                        dest,
                        chmod,
                    },
                ));
            }
            "ONBUILD" => {
                return Err(unsupported(
                    "ONBUILD",
                    "put the instructions in the Dockerfile that uses this image",
                ))
            }
            w if IGNORED.contains(&w) => notes.push(format!("line {line}: {w} ignored")),
            _ => {
                return Err(DockerfileError::Unknown {
                    line,
                    word: word.to_string(),
                })
            }
        }
    }
    let from = from.ok_or(DockerfileError::NoFrom)?;
    Ok(Dockerfile {
        from,
        steps,
        run_args,
        notes,
    })
}

/// Joins continuation lines and drops comments and blank lines: `(first line number, text)`.
fn logical_lines(text: &str) -> Result<Vec<(usize, String)>, DockerfileError> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    let mut directives = true;
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let trimmed = raw.trim();
        if directives {
            if let Some(d) = trimmed.strip_prefix('#') {
                if let Some((k, v)) = d.trim().split_once('=') {
                    if k.trim().eq_ignore_ascii_case("escape") && v.trim() != "\\" {
                        return Err(DockerfileError::Unsupported {
                            line: n,
                            what: format!("the escape character {:?}", v.trim()),
                            hint: "use the default, \\".into(),
                        });
                    }
                    continue;
                }
            }
            directives = false;
        }
        if trimmed.starts_with('#') {
            continue; // comments, also inside a continued instruction
        }
        if current.is_none() && trimmed.is_empty() {
            continue;
        }
        let (body, continues) = match trimmed.strip_suffix('\\') {
            Some(b) => (b, true),
            None => (trimmed, false),
        };
        match &mut current {
            Some((_, text)) => {
                if !body.is_empty() {
                    text.push(' ');
                    text.push_str(body.trim());
                }
            }
            None => current = Some((n, body.trim().to_string())),
        }
        if !continues {
            if let Some(c) = current.take() {
                out.push(c);
            }
        }
    }
    if let Some((line, _)) = current {
        return Err(DockerfileError::Syntax {
            line,
            message: "the instruction ends with a line continuation and no next line".into(),
        });
    }
    Ok(out)
}

fn command(rest: &str, line: usize) -> Result<Command, DockerfileError> {
    if rest.starts_with('[') {
        if let Ok(v) = serde_json::from_str::<Vec<String>>(rest) {
            if v.is_empty() {
                return Err(DockerfileError::Syntax {
                    line,
                    message: "an empty command".into(),
                });
            }
            return Ok(Command::Exec(v));
        }
        // Docker runs a malformed JSON array as a shell command; so does ember.
    }
    if rest.is_empty() {
        return Err(DockerfileError::Syntax {
            line,
            message: "an empty command".into(),
        });
    }
    Ok(Command::Shell(rest.to_string()))
}

fn valid_name(k: &str) -> bool {
    !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Splits `K=V K2="v 2"` (or, with `legacy`, `K value with spaces`) into pairs; for ARG a
/// name alone (`ARG K`) gives `None`.
fn split_assignments(rest: &str, legacy: bool) -> Result<Vec<(String, Option<String>)>, String> {
    let words = shell_words(rest)?;
    if words.is_empty() {
        return Err("nothing to set".into());
    }
    if legacy && !words[0].contains('=') {
        // `ENV K value with spaces`
        let (k, v) = rest
            .split_once(char::is_whitespace)
            .ok_or_else(|| format!("ENV {rest:?} has no value"))?;
        return Ok(vec![(k.to_string(), Some(v.trim().to_string()))]);
    }
    words
        .into_iter()
        .map(|w| match w.split_once('=') {
            Some((k, v)) => Ok((k.to_string(), Some(v.to_string()))),
            None if !legacy => Ok((w, None)),
            None => Err(format!("{w:?} is not NAME=VALUE")),
        })
        .collect()
}

/// Words with double/single quotes and backslash escapes removed (quotes keep spaces).
/// `$` is kept for [`substitute`] (single-quoted `$` is escaped as `\$`).
fn shell_words(s: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut has = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                has = true;
                loop {
                    match chars.next() {
                        None => return Err(format!("unterminated quote in {s:?}")),
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(n @ ('"' | '\\')) => cur.push(n),
                            Some('$') => cur.push_str("\\$"),
                            Some(n) => {
                                cur.push('\\');
                                cur.push(n);
                            }
                            None => return Err(format!("unterminated quote in {s:?}")),
                        },
                        Some(n) => cur.push(n),
                    }
                }
            }
            '\'' => {
                has = true;
                loop {
                    match chars.next() {
                        None => return Err(format!("unterminated quote in {s:?}")),
                        Some('\'') => break,
                        Some('$') => cur.push_str("\\$"),
                        Some(n) => cur.push(n),
                    }
                }
            }
            '\\' => {
                has = true;
                match chars.next() {
                    Some('$') => cur.push_str("\\$"),
                    Some(n) => cur.push(n),
                    None => {}
                }
            }
            c if c.is_whitespace() => {
                if has {
                    words.push(std::mem::take(&mut cur));
                    has = false;
                }
            }
            c => {
                has = true;
                cur.push(c);
            }
        }
    }
    if has {
        words.push(cur);
    }
    Ok(words)
}

/// Expands `$X`, `${X}`, `${X:-default}` and `${X:+alt}` from `vars` (unset: empty); `\$` is a
/// literal `$`.
pub fn substitute(s: &str, vars: &BTreeMap<String, String>) -> Result<String, &'static str> {
    let mut out = String::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && b.get(i + 1) == Some(&b'$') {
            out.push('$');
            i += 2;
            continue;
        }
        if b[i] != b'$' {
            let ch = s[i..].chars().next().unwrap_or_default();
            out.push(ch);
            i += ch.len_utf8();
            continue;
        }
        if b.get(i + 1) == Some(&b'{') {
            let end = s[i..].find('}').ok_or("unterminated ${...}")? + i;
            let inner = &s[i + 2..end];
            let (name, op) = match inner.find(":-").or_else(|| inner.find(":+")) {
                Some(p) => (&inner[..p], Some((&inner[p..p + 2], &inner[p + 2..]))),
                None => (inner, None),
            };
            if !valid_name(name) {
                return Err("a bad variable name in ${...}");
            }
            let val = vars.get(name).filter(|v| !v.is_empty());
            match op {
                None => out.push_str(val.map(String::as_str).unwrap_or("")),
                Some((":-", d)) => match val {
                    Some(v) => out.push_str(v),
                    None => out.push_str(&substitute(d, vars)?),
                },
                Some((_, alt)) => {
                    if val.is_some() {
                        out.push_str(&substitute(alt, vars)?)
                    }
                }
            }
            i = end + 1;
        } else {
            let start = i + 1;
            let mut end = start;
            while end < b.len() && (b[end].is_ascii_alphanumeric() || b[end] == b'_') {
                end += 1;
            }
            if end == start {
                out.push('$');
                i += 1;
                continue;
            }
            out.push_str(vars.get(&s[start..end]).map(String::as_str).unwrap_or(""));
            i = end;
        }
    }
    Ok(out)
}

/// `COPY [--flag=..]... src... dest`, in either form: (flags, paths).
fn copy_parts(rest: &str) -> Result<(Vec<String>, Vec<String>), String> {
    let mut flags = Vec::new();
    let mut rest = rest.trim();
    while rest.starts_with("--") {
        let (f, r) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
        flags.push(f.to_string());
        rest = r.trim_start();
    }
    let paths = if rest.starts_with('[') {
        serde_json::from_str::<Vec<String>>(rest).map_err(|e| format!("bad JSON array: {e}"))?
    } else {
        shell_words(rest)?
    };
    Ok((flags, paths))
}

fn is_archive(s: &str) -> bool {
    let l = s.to_ascii_lowercase();
    [
        ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst",
    ]
    .iter()
    .any(|e| l.ends_with(e))
}

/// A COPY source as a path inside the context: `.`-components dropped, a leading `/` is the
/// context's root (as in Docker); None when `..` would climb out.
pub fn normalize_source(s: &str) -> Option<String> {
    let mut parts: Vec<&str> = Vec::new();
    for c in s.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            c => parts.push(c),
        }
    }
    Some(parts.join("/"))
}

/// A destination in the image: absolute, `..`-free, relative ones under `workdir`.
pub fn resolve_dest(dest: &str, workdir: &str) -> String {
    let joined = if dest.starts_with('/') {
        dest.to_string()
    } else {
        format!("{}/{dest}", workdir.trim_end_matches('/'))
    };
    let parts: Vec<&str> = joined
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    format!("/{}", parts.join("/"))
}

/// The context's `.dockerignore`: patterns (`*`, `?`, `**`, a leading `!` re-includes), the
/// last matching pattern wins; a pattern matching a directory excludes what is under it.
#[derive(Debug, Clone, Default)]
pub struct DockerIgnore {
    rules: Vec<(bool, Vec<String>)>,
}

impl DockerIgnore {
    /// Reads the file's text.
    pub fn parse(text: &str) -> DockerIgnore {
        let mut rules = Vec::new();
        for line in text.lines() {
            let l = line.trim();
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            let (keep, pat) = match l.strip_prefix('!') {
                Some(p) => (true, p.trim()),
                None => (false, l),
            };
            let Some(norm) = normalize_source(pat) else {
                continue;
            };
            if norm.is_empty() {
                continue;
            }
            rules.push((keep, norm.split('/').map(str::to_string).collect()));
        }
        DockerIgnore { rules }
    }

    /// Whether the context path `rel` (normalised, `/`-separated) is excluded.
    pub fn excluded(&self, rel: &str) -> bool {
        let comps: Vec<&str> = rel.split('/').filter(|c| !c.is_empty()).collect();
        let mut excluded = false;
        for (keep, pat) in &self.rules {
            // A pattern matches the path or any of its parent directories.
            let hit = (1..=comps.len()).any(|n| match_components(pat, &comps[..n]));
            if hit {
                excluded = !keep;
            }
        }
        excluded
    }
}

fn match_components(pat: &[String], path: &[&str]) -> bool {
    match pat.split_first() {
        None => path.is_empty(),
        Some((p, rest)) if p == "**" => {
            (0..=path.len()).any(|skip| match_components(rest, &path[skip..]))
        }
        Some((p, rest)) => match path.split_first() {
            Some((c, prest)) => glob(p.as_bytes(), c.as_bytes()) && match_components(rest, prest),
            None => false,
        },
    }
}

/// `*` and `?` within one path component.
fn glob(p: &[u8], s: &[u8]) -> bool {
    match (p.first(), s.first()) {
        (None, None) => true,
        (Some(b'*'), _) => glob(&p[1..], s) || (!s.is_empty() && glob(p, &s[1..])),
        (Some(b'?'), Some(_)) => glob(&p[1..], &s[1..]),
        (Some(a), Some(b)) if a == b => glob(&p[1..], &s[1..]),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> Dockerfile {
        parse(text, &BTreeMap::new()).unwrap_or_else(|e| panic!("{e}"))
    }

    fn err(text: &str) -> String {
        parse(text, &BTreeMap::new()).unwrap_err().to_string()
    }

    #[test]
    fn a_typical_dockerfile() {
        let d = p(r#"# syntax=docker/dockerfile:1
# a comment
FROM python:3.12-slim AS base
ENV PIP_NO_CACHE_DIR=1 \
    APP="my app"
WORKDIR /app
COPY requirements.txt ./
RUN pip install -r requirements.txt && \
    # a comment inside
    rm -rf /root/.cache
COPY --chmod=755 run.sh /usr/local/bin/run
USER user
EXPOSE 8080
CMD ["python3", "-m", "app"]
"#);
        assert_eq!(d.from, From::Image("python:3.12-slim".into()));
        let steps: Vec<&Step> = d.steps.iter().map(|(_, s)| s).collect();
        assert_eq!(
            steps[0],
            &Step::Env(vec![
                ("PIP_NO_CACHE_DIR".into(), "1".into()),
                ("APP".into(), "my app".into())
            ])
        );
        assert_eq!(steps[1], &Step::Workdir("/app".into()));
        assert_eq!(
            steps[2],
            &Step::Copy {
                sources: vec!["requirements.txt".into()],
                dest: "./".into(),
                chmod: None
            }
        );
        assert_eq!(
            steps[3],
            &Step::Run(Command::Shell(
                "pip install -r requirements.txt && rm -rf /root/.cache".into()
            ))
        );
        assert!(matches!(
            steps[4],
            Step::Copy {
                chmod: Some(0o755),
                ..
            }
        ));
        assert_eq!(steps[5], &Step::User("user".into()));
        assert_eq!(
            steps[6],
            &Step::Cmd(Command::Exec(vec![
                "python3".into(),
                "-m".into(),
                "app".into()
            ]))
        );
        assert_eq!(d.notes, vec!["line 13: EXPOSE ignored".to_string()]);
        // Line numbers are the instruction's first line.
        assert_eq!(d.steps[3].0, 8);
    }

    #[test]
    fn args_substitute_and_reach_run_as_environment() {
        let mut given = BTreeMap::new();
        given.insert("TAG".to_string(), "3.11".to_string());
        let d = parse(
            "ARG TAG=3.12\nARG BASE=python\nFROM ${BASE}:$TAG\nARG V=1.0\nARG TAG\nENV APP_V=${V} X=${NOPE:-dflt} Y=${V:+set}\nRUN echo $V\n",
            &given,
        )
        .unwrap();
        assert_eq!(d.from, From::Image("python:3.11".into()));
        assert_eq!(
            d.steps[0].1,
            Step::Env(vec![
                ("APP_V".into(), "1.0".into()),
                ("X".into(), "dflt".into()),
                ("Y".into(), "set".into())
            ])
        );
        assert_eq!(d.steps[1].1, Step::Run(Command::Shell("echo $V".into())));
        assert_eq!(
            d.run_args,
            vec![
                (0, "V".into(), "1.0".into()),
                (0, "TAG".into(), "3.11".into())
            ]
        );
    }

    #[test]
    fn env_forms_and_quoting() {
        let d = p("FROM x\nENV A b c d\nENV B='$HOME' C=\"q \\\"x\\\"\" D=$A\n");
        assert_eq!(d.steps[0].1, Step::Env(vec![("A".into(), "b c d".into())]));
        assert_eq!(
            d.steps[1].1,
            Step::Env(vec![
                ("B".into(), "$HOME".into()),
                ("C".into(), "q \"x\"".into()),
                ("D".into(), "b c d".into())
            ])
        );
    }

    #[test]
    fn from_template_and_shell() {
        let d = p("FROM template:default\nSHELL [\"/bin/bash\", \"-c\"]\nRUN echo hi\n");
        assert_eq!(d.from, From::Template("default".into()));
        let Step::Shell(sh) = &d.steps[0].1 else {
            panic!()
        };
        let Step::Run(cmd) = &d.steps[1].1 else {
            panic!()
        };
        assert_eq!(cmd.argv(sh), vec!["/bin/bash", "-c", "echo hi"]);
    }

    #[test]
    fn refusals_name_the_line_and_the_reason() {
        for (text, want) in [
            ("RUN x\n", "line 1: RUN before FROM"),
            (
                "FROM a\nFROM b\n",
                "line 2: a second FROM (a multi-stage build)",
            ),
            ("FROM a\nCOPY --from=build /x /y\n", "COPY --from"),
            ("FROM a\nADD https://x/y.tgz /y\n", "ADD of a URL"),
            ("FROM a\nADD app.tar.gz /y\n", "ADD of a local archive"),
            ("FROM a\nBOGUS x\n", "line 2: unknown instruction \"BOGUS\""),
            (
                "FROM a\nCOPY ../secret /x\n",
                "source path \"../secret\" leaves the build context",
            ),
            ("FROM a\nCOPY a/../../b /x\n", "leaves the build context"),
            ("FROM a\nCOPY x /a/../../etc\n", "destination path"),
            ("FROM a\nCOPY *.txt /x/\n", "wildcard"),
            ("FROM a\nCOPY a b /notadir\n", "ending in '/'"),
            ("FROM a\nCOPY x\n", "needs at least one source"),
            ("FROM a\nRUN <<EOF\necho\nEOF\n", "heredoc"),
            ("FROM a\nONBUILD RUN x\n", "ONBUILD"),
            ("# escape=`\nFROM a\n", "escape character"),
            ("FROM scratch\n", "FROM scratch"),
            ("FROM a\nRUN echo \\\n", "line continuation"),
            ("FROM a\nCOPY --chown=1:1 x /y\n", "--chown"),
            ("FROM a\nCOPY --chmod=9z x /y\n", "octal"),
            ("FROM a\nENV 1X=2\n", "not valid"),
            ("FROM a\nRUN\n", "empty command"),
            ("FROM a\nUSER a b\n", "one user"),
            ("# nothing\n", "no FROM"),
        ] {
            let e = err(text);
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn sources_stay_in_the_context() {
        assert_eq!(normalize_source("./a/./b/").as_deref(), Some("a/b"));
        assert_eq!(normalize_source("/abs/x").as_deref(), Some("abs/x"));
        assert_eq!(normalize_source("a/../b").as_deref(), Some("b"));
        assert_eq!(normalize_source(".").as_deref(), Some(""));
        assert_eq!(normalize_source(".."), None);
        assert_eq!(normalize_source("a/../../b"), None);
        assert_eq!(resolve_dest("./x/", "/app"), "/app/x");
        assert_eq!(resolve_dest("/etc/x", "/app"), "/etc/x");
        assert_eq!(resolve_dest(".", "/"), "/");
    }

    #[test]
    fn substitution() {
        let vars: BTreeMap<String, String> =
            [("A".to_string(), "1".to_string()), ("E".into(), "".into())].into();
        assert_eq!(substitute("$A-${A}-\\$A-$-x", &vars).unwrap(), "1-1-$A-$-x");
        assert_eq!(substitute("${E:-d}${E:+a}${A:+a}", &vars).unwrap(), "da");
        assert!(substitute("${A", &vars).is_err());
        assert!(substitute("${A B}", &vars).is_err());
        assert_eq!(substitute("é$A", &vars).unwrap(), "é1");
    }

    #[test]
    fn dockerignore() {
        let ig = DockerIgnore::parse(
            "# comment\n.git\n*.pyc\n**/__pycache__\nbuild/\ndocs/*.md\n!docs/keep.md\n/secret.txt\n",
        );
        for (path, want) in [
            (".git", true),
            (".git/config", true),
            ("a.pyc", true),
            ("src/a.pyc", false),
            ("src/__pycache__/x", true),
            ("__pycache__", true),
            ("build/out.o", true),
            ("docs/a.md", true),
            ("docs/keep.md", false),
            ("docs/sub/a.md", false),
            ("secret.txt", true),
            ("app.py", false),
        ] {
            assert_eq!(ig.excluded(path), want, "{path}");
        }
    }
}

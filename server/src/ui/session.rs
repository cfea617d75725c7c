//! The dashboard's sessions: a random id (the cookie's value) → a per-session CSRF token and
//! an expiry, kept in the server's memory only (a restart signs everyone out).
//!
//! Rules (`docs/api.md`, "The dashboard"):
//! - a session starts when the sign-in form posts the server's bearer token; the token itself
//!   is never stored in the cookie, a URL or the browser's storage;
//! - the cookie is `HttpOnly; SameSite=Strict; Path=/`, so page scripts cannot read it and
//!   other sites cannot make the browser send it;
//! - a session ends [`IDLE`] after its last use, [`LIFETIME`] after it began, or at sign-out;
//! - every state-changing request carries the session's CSRF token in [`CSRF_HEADER`],
//!   compared in constant time.
//!
//! Time is passed in (`now`) so the expiry rules are tested without sleeping.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The session cookie's name.
pub const COOKIE: &str = "ember_ui";
/// The header that carries the CSRF token on state-changing requests.
pub const CSRF_HEADER: &str = "x-ember-csrf";
/// A session ends this long after its last request.
pub const IDLE: Duration = Duration::from_secs(60 * 60);
/// A session ends this long after sign-in, used or not.
pub const LIFETIME: Duration = Duration::from_secs(12 * 60 * 60);
/// Most sessions kept at once; signing in beyond it ends the oldest one.
pub const MAX_SESSIONS: usize = 1024;

/// Why a dashboard request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    /// No session cookie, or one naming no live session.
    #[error("not signed in (no session cookie, or the session ended): sign in at /ui/")]
    NoSession,
    /// A state-changing request without the session's CSRF token.
    #[error("missing or wrong CSRF token (send the session's token in the {CSRF_HEADER} header)")]
    Csrf,
    /// The sign-in form's token is not the server's.
    #[error("wrong token")]
    WrongToken,
    /// No randomness for a session id.
    #[error("cannot make a session id: {0}")]
    Random(String),
}

/// One session.
#[derive(Debug, Clone)]
struct Session {
    csrf: String,
    started: Instant,
    last_used: Instant,
}

impl Session {
    fn expired(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.last_used) >= IDLE
            || now.saturating_duration_since(self.started) >= LIFETIME
    }
}

/// The live sessions.
#[derive(Debug, Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, Session>>,
}

/// A new session: its id (the cookie's value) and its CSRF token.
#[derive(Debug, Clone)]
pub struct NewSession {
    /// The cookie's value.
    pub id: String,
    /// The CSRF token the page sends back in [`CSRF_HEADER`].
    pub csrf: String,
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a session for a caller that gave `given` as the token, if it is `token`.
    pub fn sign_in(
        &self,
        given: &str,
        token: &str,
        now: Instant,
    ) -> Result<NewSession, SessionError> {
        if !crate::same(given.trim().as_bytes(), token.as_bytes()) {
            return Err(SessionError::WrongToken);
        }
        let id = random_hex().map_err(|e| SessionError::Random(e.to_string()))?;
        let csrf = random_hex().map_err(|e| SessionError::Random(e.to_string()))?;
        let mut map = self.lock();
        map.retain(|_, s| !s.expired(now));
        while map.len() >= MAX_SESSIONS {
            let oldest = map
                .iter()
                .min_by_key(|(_, s)| s.started)
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => map.remove(&k),
                None => break,
            };
        }
        map.insert(
            id.clone(),
            Session {
                csrf: csrf.clone(),
                started: now,
                last_used: now,
            },
        );
        Ok(NewSession { id, csrf })
    }

    /// The CSRF token of live session `id`, marking it used; an expired one is removed.
    pub fn check(&self, id: &str, now: Instant) -> Result<String, SessionError> {
        let mut map = self.lock();
        match map.get_mut(id) {
            Some(s) if !s.expired(now) => {
                s.last_used = now;
                Ok(s.csrf.clone())
            }
            Some(_) => {
                map.remove(id);
                Err(SessionError::NoSession)
            }
            None => Err(SessionError::NoSession),
        }
    }

    /// Ends session `id`.
    pub fn sign_out(&self, id: &str) {
        self.lock().remove(id);
    }

    /// How many sessions are kept (expired ones included until they are next looked at).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no session is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Whether `given` (the request's [`CSRF_HEADER`]) is the session's token, in constant time.
pub fn csrf_ok(given: Option<&str>, expected: &str) -> Result<(), SessionError> {
    match given {
        Some(g) if crate::same(g.as_bytes(), expected.as_bytes()) => Ok(()),
        _ => Err(SessionError::Csrf),
    }
}

/// The `Set-Cookie` value that starts session `id`.
pub fn set_cookie(id: &str) -> String {
    format!(
        "{COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}",
        LIFETIME.as_secs()
    )
}

/// The `Set-Cookie` value that removes the session cookie.
pub fn clear_cookie() -> String {
    format!("{COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0")
}

/// The session id in a `Cookie` header's value, if there is one.
pub fn cookie_value(header: &str) -> Option<&str> {
    header.split(';').find_map(|pair| {
        let (name, value) = pair.trim().split_once('=')?;
        (name == COOKIE && !value.is_empty()).then_some(value)
    })
}

/// 32 random bytes as hex.
pub(crate) fn random_hex() -> std::io::Result<String> {
    use std::io::Read;
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn sign_in_needs_the_servers_token() {
        let s = Sessions::default();
        let now = Instant::now();
        assert_eq!(
            s.sign_in("nope", TOKEN, now).unwrap_err(),
            SessionError::WrongToken
        );
        assert!(s.is_empty());
        let new = s.sign_in(TOKEN, TOKEN, now).unwrap();
        assert_eq!(new.id.len(), 64);
        assert_ne!(new.id, new.csrf);
        assert!(!new.id.contains(TOKEN) && !new.csrf.contains(TOKEN));
        assert_eq!(s.check(&new.id, now).unwrap(), new.csrf);
        assert_eq!(s.check("other", now).unwrap_err(), SessionError::NoSession);
    }

    #[test]
    fn sessions_expire_when_idle_and_at_their_lifetime() {
        let s = Sessions::default();
        let t0 = Instant::now();
        let a = s.sign_in(TOKEN, TOKEN, t0).unwrap();
        // Used just before the idle limit: still live, and the idle clock restarts.
        let t1 = t0 + IDLE - Duration::from_secs(1);
        assert!(s.check(&a.id, t1).is_ok());
        assert!(s.check(&a.id, t1 + IDLE - Duration::from_secs(1)).is_ok());
        // Idle for IDLE: gone, and removed.
        let b = s.sign_in(TOKEN, TOKEN, t0).unwrap();
        assert_eq!(
            s.check(&b.id, t0 + IDLE).unwrap_err(),
            SessionError::NoSession
        );
        assert_eq!(s.check(&b.id, t0).unwrap_err(), SessionError::NoSession);
        // Kept in use, it still ends at LIFETIME.
        let c = s.sign_in(TOKEN, TOKEN, t0).unwrap();
        let mut t = t0;
        while t < t0 + LIFETIME - IDLE {
            t += IDLE / 2;
            assert!(s.check(&c.id, t).is_ok());
        }
        assert_eq!(
            s.check(&c.id, t0 + LIFETIME).unwrap_err(),
            SessionError::NoSession
        );
    }

    #[test]
    fn sign_out_ends_the_session() {
        let s = Sessions::default();
        let now = Instant::now();
        let a = s.sign_in(TOKEN, TOKEN, now).unwrap();
        s.sign_out(&a.id);
        assert_eq!(s.check(&a.id, now).unwrap_err(), SessionError::NoSession);
    }

    #[test]
    fn sessions_are_capped_oldest_first() {
        let s = Sessions::default();
        let t0 = Instant::now();
        let first = s.sign_in(TOKEN, TOKEN, t0).unwrap();
        for i in 1..=MAX_SESSIONS {
            s.sign_in(TOKEN, TOKEN, t0 + Duration::from_millis(i as u64))
                .unwrap();
        }
        assert_eq!(s.len(), MAX_SESSIONS);
        assert!(s.check(&first.id, t0).is_err());
    }

    #[test]
    fn csrf_check_wants_the_exact_token() {
        assert!(csrf_ok(Some("abc"), "abc").is_ok());
        assert_eq!(csrf_ok(None, "abc").unwrap_err(), SessionError::Csrf);
        assert_eq!(csrf_ok(Some(""), "abc").unwrap_err(), SessionError::Csrf);
        assert_eq!(csrf_ok(Some("abd"), "abc").unwrap_err(), SessionError::Csrf);
        assert_eq!(
            csrf_ok(Some("abcd"), "abc").unwrap_err(),
            SessionError::Csrf
        );
    }

    #[test]
    fn cookie_attributes() {
        let c = set_cookie("feed");
        assert!(c.starts_with("ember_ui=feed; "), "{c}");
        for attr in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=43200"] {
            assert!(c.split("; ").any(|a| a == attr), "{attr} in {c}");
        }
        let gone = clear_cookie();
        assert!(gone.contains("Max-Age=0") && gone.starts_with("ember_ui=;"));
        assert_eq!(cookie_value("a=1; ember_ui=feed; b=2"), Some("feed"));
        assert_eq!(cookie_value("ember_ui="), None);
        assert_eq!(cookie_value("xember_ui=feed"), None);
    }
}

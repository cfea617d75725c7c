//! Wall-clock time as the runtime records it: milliseconds since the Unix epoch, shown as
//! RFC 3339 (UTC, milliseconds). The store, the audit log and the API surfaces all use these.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// RFC 3339 (UTC, milliseconds) of a Unix time in ms.
pub fn rfc3339(ms: i64) -> String {
    let t = UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_has_milliseconds_and_clamps_before_the_epoch() {
        assert_eq!(super::rfc3339(1_500), "1970-01-01T00:00:01.500Z");
        assert_eq!(super::rfc3339(-5), "1970-01-01T00:00:00.000Z");
        assert!(super::now_ms() > 1_700_000_000_000);
    }
}

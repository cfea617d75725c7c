//! Secrets derived from the server's token (E2B's envd access tokens, traffic tokens and
//! signed file URLs, the port proxy's traffic token): nothing is stored, they survive restarts
//! and change with the server's token.

use sha2::{Digest, Sha256};

/// HMAC-SHA256 (RFC 2104) of `msg` under `key`.
pub fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(k.map(|b| b ^ 0x36));
    inner.update(msg);
    let mut outer = Sha256::new();
    outer.update(k.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// A per-sandbox secret derived from the server's token: 32 hex digits of
/// HMAC-SHA256(token, "<purpose>:<id>"). Nothing is stored; it survives restarts and
/// changes with the server's token.
pub fn derive_token(server_token: &str, purpose: &str, id: &str) -> String {
    let mac = hmac_sha256(
        server_token.as_bytes(),
        format!("{purpose}:{id}").as_bytes(),
    );
    mac[..16].iter().map(|b| format!("{b:02x}")).collect()
}

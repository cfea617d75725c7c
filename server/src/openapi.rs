//! The OpenAPI 3 document, generated from the handlers' `#[utoipa::path]` annotations and
//! the request/response types' schemas. Its paths are not listed here: they come from the
//! route table (`table` in lib.rs) that also builds the router, so every native route is in
//! it and nothing else (a test checks both ways). [`ApiDoc`] holds the rest: the info, the
//! schemas, the bearer scheme, the tags.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::ports::{ExposeBody, NetworkBody};
use super::types::*;
use ember_runtime::{
    ArtifactInfo, AuditRecord, CreateRequest, ExposedPort, ForkRequest, NetMode, NetworkPolicy,
    OnTimeout, Resources, SandboxInfo, SandboxNetwork, SnapshotInfo, SnapshotRequest, State,
    Transition,
};

/// The document without its paths, which [`document`] adds.
#[derive(Debug, OpenApi)]
#[openapi(
    info(
        title = "ember",
        description = "KVM microVM sandboxes for running AI agents' code: the native API of \
                       `ember serve`. Authenticate with `Authorization: Bearer <token>` (the \
                       token is in `$EMBER_HOME/token`). Errors are \
                       `{\"error\":{\"code\",\"message\"}}`. See docs/api.md."
    ),
    components(schemas(
        ErrorBody, ErrorDetail, OkBody, StreamLine, TemplateSummary, VmShapeInfo, BuildBody,
        CreateRequest, SandboxInfo, State, OnTimeout, NetworkPolicy, NetMode, ExposedPort, SandboxNetwork, Resources, Transition,
        TimeoutBody, ResumeBody, ForkRequest, SnapshotRequest, SnapshotInfo, ContextBody, ContextOut,
        RunCodeBody, ExecBody, ExecUserBody, EntryOut, StatOut, WrittenOut, MkdirBody,
        RenameBody, ArtifactInfo, AuditRecord, ExposeBody, NetworkBody,
        ember_runtime::NetworkInfo, ember_runtime::netpolicy::NetStats, ember_runtime::netpolicy::DropStats,
        ember_runtime::netpolicy::edge::EdgeStats, ember_runtime::netpolicy::policy::HostRule,
        ember_runtime::netpolicy::policy::Transform, ember_runtime::netpolicy::policy::EgressProxy,
        ember_runtime::secrets::SecretInfo,
        super::secrets::SecretCreateBody, super::secrets::SecretRotateBody,
        ember_runtime::volumes::VolumeInfo, ember_runtime::volumes::VolumeEntry,
        ember_runtime::volumes::VolumeMount, super::volumes::VolumeCreateBody,
    )),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    tags(
        (name = "server", description = "Health, metrics, this document"),
        (name = "templates", description = "Warm snapshots sandboxes start from"),
        (name = "sandboxes", description = "Lifecycle"),
        (name = "snapshots", description = "Durable named snapshots"),
        (name = "contexts", description = "Code contexts (interpreters) in a sandbox"),
        (name = "code", description = "Running code and programs (NDJSON streams)"),
        (name = "files", description = "Guest files"),
        (name = "artifacts", description = "Files copied out of the outputs directory"),
        (name = "network", description = "Network policy, exposed ports (the reverse proxy \
            at /v1/sandboxes/{id}/ports/{port}/… is not listed: any method, any path)"),
        (name = "audit", description = "The audit log"),
        (name = "secrets", description = "Secrets: values go in, never come out; sandboxes' \
            network rules use them through the host-side egress proxy"),
        (name = "volumes", description = "Named durable directories, mounted into sandboxes at \
            create (`volume_mounts`); their files through the content API (docs/volumes.md)"),
    )
)]
pub struct ApiDoc;

/// Adds the `bearer` security scheme.
#[derive(Debug)]
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("The token in $EMBER_HOME/token"))
                    .build(),
            ),
        );
    }
}

/// The document: [`ApiDoc`] with the native routes' paths.
pub fn document() -> utoipa::openapi::OpenApi {
    super::table(ApiDoc::openapi()).api.into_openapi()
}

/// The document as JSON.
pub fn json() -> String {
    document()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\":\"cannot render the OpenAPI document: {e}\"}}"))
}

#[cfg(test)]
mod tests {
    /// The document as it was before the runtime / server / cli split (and as clients have
    /// generated code from): same paths, same schemas. A deliberate API change updates the
    /// file in the same commit (`EMBER_UPDATE_OPENAPI=1 cargo test -p ember-server openapi`).
    const GOLDEN: &str = include_str!("openapi.golden.json");

    #[test]
    fn the_document_matches_the_recorded_one() {
        let now: serde_json::Value = serde_json::from_str(&super::json()).unwrap();
        if std::env::var_os("EMBER_UPDATE_OPENAPI").is_some() {
            let path = concat!(env!("CARGO_MANIFEST_DIR"), "/src/openapi.golden.json");
            std::fs::write(path, serde_json::to_string_pretty(&now).unwrap()).unwrap();
            return;
        }
        let golden: serde_json::Value = serde_json::from_str(GOLDEN).unwrap();
        for key in ["paths", "components"] {
            let (a, b) = (&now[key], &golden[key]);
            if a != b {
                let names = |v: &serde_json::Value| -> Vec<String> {
                    v.as_object()
                        .map(|o| o.keys().cloned().collect())
                        .unwrap_or_default()
                };
                panic!(
                    "the OpenAPI document's {key} changed (now {:?}, recorded {:?}); if that \
                     is intended, run with EMBER_UPDATE_OPENAPI=1",
                    names(a),
                    names(b)
                );
            }
        }
        assert_eq!(
            now, golden,
            "the OpenAPI document changed outside paths/components"
        );
    }
}

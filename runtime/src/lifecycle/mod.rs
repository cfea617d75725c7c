//! Lifecycle: create, pause, resume, kill, timeouts, snapshot, fork, VMM deaths, and the
//! reclaim of what a crashed server left. One file per idea, each with its own `impl Runtime`:
//!
//! - `create.rs`: `create` — where a sandbox comes from (template or named snapshot), the
//!   checks of a request, the capacity reservation, and `start_vm` (a warm pool member or a
//!   fresh jailed VMM), which resume and fork also start through.
//! - `suspend.rs`: `pause` (the pause snapshot, layered over its base when it can be) and
//!   `resume`, with their helpers: `retire_vm` (a paused VMM stopped off the caller's path),
//!   `settle` (wait out a transient state and a retiring VMM) and `drain` (calls in flight).
//! - `fork.rs`: named snapshots (`snapshot`, `snapshots`, `delete_snapshot`) and `fork`, and
//!   `snapshot_to`, which writes every snapshot the runtime takes (a pause's too).
//! - `timers.rs`: `set_timeout` and the timer thread — timeouts, max lifetimes, paused
//!   retention, record retention.
//! - `moved.rs`: a paused sandbox moving between hosts (`export_paused`, `import_paused`,
//!   `forget`) and the [`crate::LifecycleHooks`] an embedder (the fleet's node) follows pauses
//!   and resumes with.
//! - `fence.rs`: a fence (`freeze_vms`, `thaw_vms`: every running VM's vCPUs stopped and
//!   started again without a pause) and the VMM watchdogs' keep-alives ([`KeepAlive`]), for
//!   an embedder that others may declare lost.
//! - `reclaim.rs`: what ended without the runtime ending it: a VMM that died (`vmm_exited`,
//!   called by the watcher) and what a previous server left (`reclaim`, at open).
//!
//! This file: `kill` and `stop` (which a kill request, a timeout's kill and a failed fork's
//! clean-up call), the steps that stop a VM on purpose (`stop_vm`, `release_vm`), and the
//! small helpers the files share (`check_name`, `SnapshotMeta`). Kill is here, not in
//! `suspend.rs` or `reclaim.rs`: the other files all reach it (`timers.rs` kills, `fork.rs`
//! stops the clones of a failed fork, `suspend.rs` stops the VM of a failed pause and
//! retires a paused one through `release_vm`), and `reclaim.rs` is only for what ended
//! without the runtime asking.

use std::collections::BTreeMap;

use ember_jailer::jail::Timings;

use crate::jailed::{self, Live};
use crate::types::*;
use crate::{lock, Runtime, RuntimeError, SlotState};

pub use fence::KeepAlive;
pub use moved::{LifecycleHooks, ResumeVerdict};

mod boot;
mod create;
mod fence;
mod fork;
mod moved;
mod reclaim;
mod suspend;
mod timers;

pub(crate) fn check_name(name: &str) -> Result<(), RuntimeError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(RuntimeError::Invalid(format!(
            "invalid name {name:?}: 1 to 64 letters, digits, '-', '_' or '.', not starting with '.'"
        )))
    }
}

impl Runtime {
    /// Kills a sandbox (its artifacts are copied out first).
    pub fn kill(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        self.timed(Some(id), "kill", serde_json::json!({}), || {
            self.stop(id, "killed by request")
        })
    }

    pub(crate) fn stop(&self, id: &str, reason: &str) -> Result<SandboxInfo, RuntimeError> {
        let slot = match self.slot(id) {
            Ok(s) => s,
            Err(RuntimeError::Conflict { .. }) => return self.get(id),
            Err(e) => return Err(e),
        };
        let st = lock(&slot.st);
        let mut st = self.settle(&slot, st);
        if st.row.state.is_final() {
            return Ok(st.row.info());
        }
        st.cancel_streams();
        if let Some(vm) = st.vm.clone() {
            let row = st.row.clone();
            drop(st);
            if let Err(e) = self.collect_from(&row, &vm) {
                tracing::warn!("sandbox {id}: artifacts not collected: {e}");
            }
            st = lock(&slot.st);
        }
        self.stop_vm(&mut st);
        if let Some(dir) = st.row.pause_dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
        self.transition(&slot, &mut st, State::Stopped, Some(reason.to_string()));
        let info = st.row.info();
        drop(st);
        lock(&self.inner.slots).remove(id);
        // What the host knew of its guest's processes and watches went with it.
        self.forget_watchers(id);
        if let Err(e) = self.store().forget_processes(id, None) {
            tracing::warn!("sandbox {id}: its process records not forgotten: {e}");
        }
        let _ = std::fs::remove_dir_all(self.inner.cfg.sandbox_dir(id));
        Ok(info)
    }

    /// Stops the slot's VMM on purpose and releases its jail (state unchanged).
    fn stop_vm(&self, st: &mut SlotState) {
        st.expected_exit = true;
        if let Some(vm) = st.vm.take() {
            self.release_vm(&st.row.id, &vm);
        }
        self.free_uid(st.row.uid.take());
        st.row.jail_id = None;
        st.row.pid = None;
    }

    /// Kills a VMM the slot no longer holds and releases its jail and network.
    fn release_vm(&self, id: &str, vm: &Live) {
        let mut phases = Timings::new();
        let _ = vm.sandbox.kill();
        phases.mark("kill");
        if let Err(e) = jailed::release_jail(&vm.jail) {
            tracing::error!("sandbox {id}: {e}");
        }
        phases.mark("jail");
        if let Some(net) = &vm.net {
            self.audit_net_drops(id, net);
            self.inner.net.teardown(net);
        }
        phases.mark("network");
        tracing::debug!("sandbox {id}: VM stopped: {}", phases.summary());
    }
}

/// What the runtime records beside a snapshot it wrote.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
struct SnapshotMeta {
    env: BTreeMap<String, String>,
    outputs: String,
    resources: Resources,
    /// The volumes the sandbox mounted: a sandbox created from the snapshot mounts the same
    /// ones (its guest's memory has them mounted; a booted one mounts them again).
    #[serde(default)]
    volumes: Vec<crate::volumes::VolumeMount>,
}

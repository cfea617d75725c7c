//! What ended without the runtime ending it: a VMM that died (the watcher calls
//! `vmm_exited`), and, at open, what a previous server left — VMMs still running are
//! re-attached, sandboxes caught mid-transition put in a true state, orphaned jails,
//! cgroups, network namespaces and directories removed.

use std::sync::Arc;

use crate::jailed;
use crate::types::*;
use crate::{lock, Runtime, RuntimeError, Slot};

impl Runtime {
    /// Called by the watcher when a VMM exited.
    pub(crate) fn vmm_exited(&self, id: &str, jail_id: &str) {
        let Some(slot) = lock(&self.inner.slots).get(id).cloned() else {
            return;
        };
        let mut st = lock(&slot.st);
        let ours = st.vm.as_ref().is_some_and(|v| v.jail.id == jail_id);
        // A pausing sandbox's VMM exits when its snapshot is written (before `stop_vm` can
        // mark the exit expected); a failed snapshot is handled by the pause itself.
        if !ours || st.expected_exit || st.row.state == State::Pausing {
            return;
        }
        let Some(vm) = st.vm.take() else { return };
        let status = vm.sandbox.exit_status().unwrap_or_else(|| "exited".into());
        let ooms = jailed::oom_kills(&vm.jail);
        let _ = vm.sandbox.kill();
        let released = jailed::release_jail(&vm.jail);
        if let Some(net) = &vm.net {
            self.inner.net.teardown(net);
        }
        let mut reason = format!("the VMM died unexpectedly ({status})");
        if ooms > 0 {
            reason.push_str(&format!(
                "; its cgroup recorded {ooms} OOM kill(s) (memory limit {} MiB)",
                st.row.resources.memory_limit_mib
            ));
        }
        if let Err(e) = released {
            reason.push_str(&format!("; {e}"));
        }
        tracing::warn!("sandbox {id}: {reason}");
        self.free_uid(st.row.uid.take());
        st.row.jail_id = None;
        // Everything is released before the state says so.
        let _ = std::fs::remove_dir_all(self.inner.cfg.sandbox_dir(id));
        lock(&self.inner.metrics).vmm_failures += 1;
        self.transition(&slot, &mut st, State::Failed, Some(reason));
        drop(st);
        lock(&self.inner.slots).remove(id);
    }

    /// At open: re-attach VMMs that still run, put sandboxes caught mid-transition into a
    /// state that is true, and remove jails, cgroups and directories nothing refers to.
    pub(crate) fn reclaim(&self) -> Result<(), RuntimeError> {
        let cfg = &self.inner.cfg;
        let bins = &self.inner.bins;
        let rows = self.store().sandboxes(true)?;
        let mut keep_jails = std::collections::HashSet::new();
        for mut row in rows {
            let id = row.id.clone();
            let slot = Slot::new(row.clone(), None);
            let adopted = match (row.state, &row.jail_id, row.pid) {
                (State::Running | State::Pausing, Some(j), Some(pid)) => {
                    jailed::adopt(cfg, bins, &id, j, pid, &row.source_dir).ok()
                }
                _ => None,
            };
            let mut st = lock(&slot.st);
            match (row.state, adopted) {
                (State::Running | State::Pausing, Some(mut live)) => {
                    let jail_id = live.jail.id.clone();
                    keep_jails.insert(jail_id.clone());
                    match self.inner.net.adopt(&jail_id, &row.network.policy) {
                        Ok(net) => live.net = net,
                        Err(e) => tracing::error!("sandbox {id}: its network: {e}"),
                    }
                    if let Some(w) = lock(&self.inner.watcher).clone() {
                        let _ = w.watch(&id, &jail_id, &live.sandbox);
                    }
                    live.sandbox
                        .set_template(row.template.clone(), row.env.clone());
                    self.volumes_started(&id, &live);
                    st.vm = Some(Arc::new(live));
                    if let Some(u) = row.uid {
                        lock(&self.inner.uids).insert(u);
                    }
                    if row.state == State::Pausing {
                        self.transition(
                            &slot,
                            &mut st,
                            State::Running,
                            Some(
                                "re-attached after a server restart (its pause was cut off)".into(),
                            ),
                        );
                    } else {
                        let _ = self.store().add_transition(
                            &id,
                            Some(State::Running),
                            State::Running,
                            Some("re-attached after a server restart"),
                        );
                    }
                }
                (State::Paused, _) if row.pause_dir.as_ref().is_some_and(|d| d.is_dir()) => {
                    st.paused_ms = self
                        .store()
                        .transitions(&id)
                        .ok()
                        .and_then(|h| h.last().map(|t| t.at.clone()))
                        .and_then(|t| humantime::parse_rfc3339(&t).ok())
                        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                        .map(|d| d.as_millis() as i64);
                }
                (State::Resuming, _) if row.pause_dir.as_ref().is_some_and(|d| d.is_dir()) => {
                    if let Some(j) = &row.jail_id {
                        jailed::kill_cgroup(cfg, j);
                    }
                    row.jail_id = None;
                    row.pid = None;
                    st.row = row.clone();
                    self.transition(
                        &slot,
                        &mut st,
                        State::Paused,
                        Some("the server restarted during its resume".into()),
                    );
                }
                (state, _) => {
                    if let Some(j) = &row.jail_id {
                        jailed::kill_cgroup(cfg, j);
                    }
                    st.row.pid = None;
                    st.row.jail_id = None;
                    self.transition(
                        &slot,
                        &mut st,
                        State::Failed,
                        Some(format!(
                            "found {} when the server restarted, but its VMM was gone",
                            state.as_str()
                        )),
                    );
                    drop(st);
                    let _ = std::fs::remove_dir_all(cfg.sandbox_dir(&id));
                    continue;
                }
            }
            drop(st);
            lock(&self.inner.slots).insert(id, slot);
        }
        // Jails (and their cgroups) nothing refers to.
        let mut orphans = std::collections::BTreeSet::new();
        if let Ok(entries) = std::fs::read_dir(cfg.jails_dir()) {
            for e in entries.flatten() {
                orphans.insert(e.file_name().to_string_lossy().into_owned());
            }
        }
        orphans.extend(jailed::cgroup_jail_ids(cfg));
        for j in orphans.difference(&keep_jails.iter().cloned().collect()) {
            if ember_jailer::config::validate_id(j).is_err() {
                continue;
            }
            tracing::warn!("reclaiming orphaned jail {j}");
            jailed::kill_cgroup(cfg, j);
            let jail = jailed::jail_config_for(cfg, bins, j);
            if let Err(e) = jailed::release_jail(&jail) {
                tracing::error!("{e}");
            }
        }
        // Network namespaces no re-attached VM uses (their veths, TAPs and rules go with them).
        let keep_ns: std::collections::BTreeSet<String> = lock(&self.inner.slots)
            .values()
            .filter_map(|s| {
                lock(&s.st)
                    .vm
                    .as_ref()
                    .and_then(|v| v.net.as_ref())
                    .map(|n| n.name.clone())
            })
            .collect();
        let reclaimed = self.inner.net.reclaim(&keep_ns);
        if reclaimed > 0 {
            tracing::warn!("reclaimed {reclaimed} orphaned sandbox network namespace(s)");
        }
        // State directories of sandboxes that no longer live.
        let live: std::collections::HashSet<String> =
            lock(&self.inner.slots).keys().cloned().collect();
        if let Ok(entries) = std::fs::read_dir(cfg.home.join("sandboxes")) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if !live.contains(&name) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let _ = std::fs::remove_dir_all(cfg.home.join("forks"));
        Ok(())
    }
}

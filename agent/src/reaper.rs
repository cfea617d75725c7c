//! Waiting for the agent's children when PID 1 also reaps every orphan.
//!
//! PID 1 must reap whatever is re-parented to it, so its main thread loops in `waitpid(-1)`. That
//! would steal the exit status of the programs `exec` started, so those are *registered*: they
//! are spawned with the registry's lock held and their pid recorded, and the reaper hands a
//! registered pid's status to the thread waiting for it instead of throwing it away. Because the
//! reaper takes the same lock before looking a pid up, a child that exits at once is still found.
//!
//! Outside PID 1 (tests on a host, where other threads wait for their own children)
//! [`Children::Direct`] waits for the pid itself and reaps nothing else.

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use crate::protocol::ExitStatus;

/// Decodes a `waitpid` status word.
pub fn exit_status(status: libc::c_int) -> ExitStatus {
    if libc::WIFSIGNALED(status) {
        ExitStatus::Signal(libc::WTERMSIG(status))
    } else {
        ExitStatus::Code(libc::WEXITSTATUS(status))
    }
}

/// How the agent waits for the programs it starts.
#[derive(Debug, Clone)]
pub enum Children {
    /// `waitpid(pid)` on the waiting thread; for processes that are not PID 1.
    Direct,
    /// Statuses come from a [`Registry`] whose reaper runs elsewhere (PID 1's main thread).
    Registry(Arc<Registry>),
}

impl Children {
    /// Runs `spawn`, which returns the new child's pid along with anything else, so that the
    /// child's status is kept for [`Children::wait`].
    pub fn spawn<T, E>(
        &self,
        spawn: impl FnOnce() -> Result<(libc::pid_t, T), E>,
    ) -> Result<(libc::pid_t, T), E> {
        match self {
            Children::Direct => spawn(),
            Children::Registry(registry) => registry.spawn(spawn),
        }
    }

    /// Waits until `pid` (started through [`Children::spawn`]) has ended and reaps it.
    pub fn wait(&self, pid: libc::pid_t) -> io::Result<ExitStatus> {
        match self {
            Children::Direct => wait_pid(pid).map(exit_status),
            Children::Registry(registry) => registry.wait(pid),
        }
    }
}

fn wait_pid(pid: libc::pid_t) -> io::Result<libc::c_int> {
    loop {
        let mut status = 0;
        // SAFETY: `status` is a valid out-pointer for the duration of the call.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            return Ok(status);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Registered children: `None` while running, then their wait status. (Not a HashMap:
    /// its random hash keys would cost a `getrandom` syscall at start-up.)
    children: BTreeMap<libc::pid_t, Option<libc::c_int>>,
    /// Bumped by every spawn, so that a reaper that saw "no children" knows when to look again.
    generation: u64,
}

/// Registered children and their statuses; see the module documentation.
#[derive(Debug, Default)]
pub struct Registry {
    state: Mutex<State>,
    changed: Condvar,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A thread that panicked while holding the lock (PID 1 reboots on panics anyway) left
        // the map consistent: every update is a single insert or assignment.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn spawn<T, E>(
        &self,
        spawn: impl FnOnce() -> Result<(libc::pid_t, T), E>,
    ) -> Result<(libc::pid_t, T), E> {
        let mut state = self.lock();
        let (pid, value) = spawn()?;
        state.children.insert(pid, None);
        state.generation = state.generation.wrapping_add(1);
        drop(state);
        self.changed.notify_all();
        Ok((pid, value))
    }

    fn wait(&self, pid: libc::pid_t) -> io::Result<ExitStatus> {
        let mut state = self.lock();
        loop {
            match state.children.get(&pid) {
                Some(Some(status)) => {
                    let status = *status;
                    state.children.remove(&pid);
                    return Ok(exit_status(status));
                }
                Some(None) => {
                    state = self
                        .changed
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                None => {
                    return Err(io::Error::new(
                        io::ErrorKind::NotFound,
                        format!("pid {pid} is not a registered child"),
                    ))
                }
            }
        }
    }

    /// Records that `pid` ended with `status`; the status of an unregistered pid (an orphan) is
    /// dropped. Returns whether the pid was registered.
    pub fn record(&self, pid: libc::pid_t, status: libc::c_int) -> bool {
        let mut state = self.lock();
        let Some(slot) = state.children.get_mut(&pid) else {
            return false;
        };
        *slot = Some(status);
        drop(state);
        self.changed.notify_all();
        true
    }

    /// Reaps every child of this process forever: PID 1's main thread.
    pub fn reap_forever(&self) -> ! {
        loop {
            self.reap_next(|| {
                let mut status = 0;
                // SAFETY: `status` is a valid out-pointer for the duration of the call.
                let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
                if pid > 0 {
                    Ok((pid, status))
                } else {
                    Err(io::Error::last_os_error())
                }
            });
        }
    }

    /// One round of the reaper: `wait_any` is `waitpid(-1)`. When there is no child at all it
    /// blocks until the next spawn instead of spinning.
    fn reap_next(&self, wait_any: impl FnOnce() -> io::Result<(libc::pid_t, libc::c_int)>) {
        let generation = self.lock().generation;
        match wait_any() {
            Ok((pid, status)) => {
                self.record(pid, status);
            }
            Err(e) if e.raw_os_error() == Some(libc::ECHILD) => {
                let mut state = self.lock();
                while state.generation == generation {
                    state = self
                        .changed
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn statuses_decode() {
        assert_eq!(exit_status(3 << 8), ExitStatus::Code(3));
        assert_eq!(exit_status(libc::SIGKILL), ExitStatus::Signal(9));
    }

    #[test]
    fn direct_mode_waits_for_its_own_child() {
        let children = Children::Direct;
        let (pid, ()) = children
            .spawn(|| crate::process::spawn_shell(b"exit 5").map(|pid| (pid, ())))
            .unwrap();
        assert_eq!(children.wait(pid).unwrap(), ExitStatus::Code(5));
    }

    #[test]
    fn registry_hands_statuses_to_waiters_and_drops_orphans() {
        let registry = Arc::new(Registry::new());
        let children = Children::Registry(registry.clone());
        let (pid, tag) = children.spawn(|| Ok::<_, io::Error>((4242, "x"))).unwrap();
        assert_eq!(tag, "x");

        // An orphan's status goes nowhere.
        registry.reap_next(|| Ok((777, 0)));
        let waiter = {
            let children = children.clone();
            std::thread::spawn(move || children.wait(pid).unwrap())
        };
        std::thread::sleep(Duration::from_millis(20));
        assert!(!waiter.is_finished());
        // The reaper reaps our child: the waiter gets its status, once.
        registry.reap_next(|| Ok((4242, 9)));
        assert_eq!(waiter.join().unwrap(), ExitStatus::Signal(9));
        assert!(children.wait(pid).is_err());
        assert!(!registry.record(4242, 0));
    }

    #[test]
    fn a_child_that_exits_before_anyone_waits_is_kept() {
        let registry = Registry::new();
        registry.spawn(|| Ok::<_, io::Error>((10, ()))).unwrap();
        assert!(registry.record(10, 2 << 8));
        assert_eq!(registry.wait(10).unwrap(), ExitStatus::Code(2));
    }

    #[test]
    fn failed_spawns_register_nothing() {
        let registry = Registry::new();
        let err = registry
            .spawn(|| Err::<(libc::pid_t, ()), _>("no"))
            .unwrap_err();
        assert_eq!(err, "no");
        assert!(registry.lock().children.is_empty());
        assert_eq!(registry.lock().generation, 0);
    }

    #[test]
    fn reaper_without_children_sleeps_until_a_spawn() {
        let registry = Arc::new(Registry::new());
        let reaper = {
            let registry = registry.clone();
            std::thread::spawn(move || {
                registry.reap_next(|| Err(io::Error::from_raw_os_error(libc::ECHILD)))
            })
        };
        std::thread::sleep(Duration::from_millis(30));
        assert!(!reaper.is_finished(), "the reaper must block, not spin");
        registry.spawn(|| Ok::<_, io::Error>((5, ()))).unwrap();
        reaper.join().unwrap();
    }
}

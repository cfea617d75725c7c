//! Cgroups for one jail, on cgroup v1 (one hierarchy per controller under
//! `<root>/<controller>`) or cgroup v2 (one hierarchy at `<root>`).
//!
//! Planning (`plan`) is pure and produces the list of filesystem steps;
//! [`Cgroups::create`] carries them out. The layout is
//! `<root>/<controller>/<parent>/<id>` on v1 and `<root>/<parent>/<id>` on v2.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::CgroupLimits;

/// `statfs` magic of a cgroup v1 hierarchy.
const CGROUP_SUPER_MAGIC: i64 = 0x0027_e0eb;
/// `statfs` magic of the cgroup v2 hierarchy.
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// Which cgroup interface a root uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// Controllers mounted separately under `<root>/<controller>`.
    V1,
    /// The unified hierarchy mounted at `<root>`.
    V2,
}

/// A failure while setting up or removing cgroups.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// `statfs` on the root failed.
    #[error("cannot inspect cgroup root {path:?}: {source}")]
    Detect {
        /// The root.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A v1 controller directory is not a cgroup v1 mount.
    #[error("cgroup v1 controller `{controller}` is not mounted at {path:?}")]
    ControllerNotMounted {
        /// The controller.
        controller: String,
        /// Where it was expected.
        path: PathBuf,
    },
    /// A v2 controller cannot be enabled.
    #[error(
        "cgroup v2 controller `{controller}` is not available in {path:?} \
         (available: {available:?}; on a hybrid host it may be bound to a v1 hierarchy)"
    )]
    ControllerUnavailable {
        /// The controller.
        controller: String,
        /// The `cgroup.controllers` file read.
        path: PathBuf,
        /// What the file listed.
        available: String,
    },
    /// `mkdir` of a cgroup failed.
    #[error("cannot create cgroup {path:?}: {source}")]
    Mkdir {
        /// The cgroup directory.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The jail's cgroup already exists and is in use.
    #[error("cgroup {path:?} already exists and holds processes {procs:?}; is the id in use?")]
    InUse {
        /// The cgroup directory.
        path: PathBuf,
        /// Pids found in `cgroup.procs`.
        procs: String,
    },
    /// Reading a cgroup file failed.
    #[error("cannot read {path:?}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// Writing a cgroup file failed.
    #[error("cannot write {value:?} to {path:?}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// What was written.
        value: String,
        /// Why.
        source: io::Error,
    },
    /// `rmdir` of a cgroup failed.
    #[error("cannot remove cgroup {path:?}: {source}")]
    Remove {
        /// The cgroup directory.
        path: PathBuf,
        /// Why (EBUSY: processes are still in it).
        source: io::Error,
    },
}

/// Detects the cgroup version from the filesystem type of `root`:
/// `cgroup2` means v2, anything else (normally a tmpfs holding one mount per
/// controller) means v1.
pub fn detect_version(root: &Path) -> Result<CgroupVersion, CgroupError> {
    let magic = crate::sys::fs_magic(root).map_err(|source| CgroupError::Detect {
        path: root.to_path_buf(),
        source,
    })?;
    Ok(if magic == CGROUP2_SUPER_MAGIC {
        CgroupVersion::V2
    } else {
        CgroupVersion::V1
    })
}

/// One filesystem step of a cgroup plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// v1: `path` must be a cgroup v1 mount.
    CheckV1Mount {
        controller: &'static str,
        path: PathBuf,
    },
    /// v2: each controller must be listed in `path` (`cgroup.controllers`).
    CheckV2Controllers {
        path: PathBuf,
        controllers: Vec<&'static str>,
    },
    /// v2: write `+controller` to `dir/cgroup.subtree_control` if missing.
    EnableControllers {
        dir: PathBuf,
        controllers: Vec<&'static str>,
    },
    /// `mkdir`; an existing intermediate directory is fine, an existing leaf
    /// must be empty of processes.
    Mkdir { path: PathBuf, leaf: bool },
    /// Copy `from` into `to` if `to` is empty (v1 cpuset.cpus/mems).
    CopyIfEmpty { from: PathBuf, to: PathBuf },
    /// Write `value` into `path`.
    Write { path: PathBuf, value: String },
}

/// A planned set of cgroups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    pub version: CgroupVersion,
    pub steps: Vec<Step>,
    /// Leaf cgroups, with the v1 controller each belongs to.
    pub leaves: Vec<Leaf>,
}

/// A jail's cgroup directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leaf {
    /// v1 controller (directory name under the root); `None` on v2.
    pub controller: Option<String>,
    /// The cgroup directory.
    pub path: PathBuf,
}

/// v1 controllers needed for `limits`, in setup order.
fn needed_controllers(limits: &CgroupLimits) -> Vec<&'static str> {
    let mut c = Vec::new();
    if limits.cpuset_cpus.is_some() || limits.cpuset_mems.is_some() {
        c.push("cpuset");
    }
    if limits.cpu_quota_us.is_some() || limits.cpu_period_us.is_some() {
        c.push("cpu");
    }
    if limits.memory_bytes.is_some() {
        c.push("memory");
    }
    if limits.pids_max.is_some() {
        c.push("pids");
    }
    c
}

/// Plans the cgroups of jail `id` under `parent` (relative) in `root`.
pub(crate) fn plan(
    version: CgroupVersion,
    root: &Path,
    parent: &Path,
    id: &str,
    limits: &CgroupLimits,
) -> Plan {
    let controllers = needed_controllers(limits);
    let mut steps = Vec::new();
    let mut leaves = Vec::new();
    let write = |path: PathBuf, value: String| Step::Write { path, value };
    match version {
        CgroupVersion::V1 => {
            for &ctrl in &controllers {
                let mount = root.join(ctrl);
                steps.push(Step::CheckV1Mount {
                    controller: ctrl,
                    path: mount.clone(),
                });
                let mut dir = mount;
                for comp in parent.components() {
                    let up = dir.clone();
                    dir.push(comp);
                    steps.push(Step::Mkdir {
                        path: dir.clone(),
                        leaf: false,
                    });
                    if ctrl == "cpuset" {
                        // A new v1 cpuset is empty and cannot take tasks.
                        for f in ["cpuset.cpus", "cpuset.mems"] {
                            steps.push(Step::CopyIfEmpty {
                                from: up.join(f),
                                to: dir.join(f),
                            });
                        }
                    }
                }
                let up = dir.clone();
                let leaf = dir.join(id);
                steps.push(Step::Mkdir {
                    path: leaf.clone(),
                    leaf: true,
                });
                match ctrl {
                    "cpuset" => {
                        match &limits.cpuset_mems {
                            Some(m) => steps.push(write(leaf.join("cpuset.mems"), m.clone())),
                            None => steps.push(Step::CopyIfEmpty {
                                from: up.join("cpuset.mems"),
                                to: leaf.join("cpuset.mems"),
                            }),
                        }
                        match &limits.cpuset_cpus {
                            Some(c) => steps.push(write(leaf.join("cpuset.cpus"), c.clone())),
                            None => steps.push(Step::CopyIfEmpty {
                                from: up.join("cpuset.cpus"),
                                to: leaf.join("cpuset.cpus"),
                            }),
                        }
                    }
                    "cpu" => {
                        if let Some(p) = limits.cpu_period_us {
                            steps.push(write(leaf.join("cpu.cfs_period_us"), p.to_string()));
                        }
                        if let Some(q) = limits.cpu_quota_us {
                            steps.push(write(leaf.join("cpu.cfs_quota_us"), q.to_string()));
                        }
                    }
                    "memory" => {
                        if let Some(m) = limits.memory_bytes {
                            steps.push(write(leaf.join("memory.limit_in_bytes"), m.to_string()));
                        }
                    }
                    "pids" => {
                        if let Some(p) = limits.pids_max {
                            steps.push(write(leaf.join("pids.max"), p.to_string()));
                        }
                    }
                    _ => {}
                }
                leaves.push(Leaf {
                    controller: Some(ctrl.to_string()),
                    path: leaf,
                });
            }
        }
        CgroupVersion::V2 => {
            if !controllers.is_empty() {
                steps.push(Step::CheckV2Controllers {
                    path: root.join("cgroup.controllers"),
                    controllers: controllers.clone(),
                });
            }
            let mut dir = root.to_path_buf();
            for comp in parent.components() {
                if !controllers.is_empty() {
                    steps.push(Step::EnableControllers {
                        dir: dir.clone(),
                        controllers: controllers.clone(),
                    });
                }
                dir.push(comp);
                steps.push(Step::Mkdir {
                    path: dir.clone(),
                    leaf: false,
                });
            }
            if !controllers.is_empty() {
                steps.push(Step::EnableControllers {
                    dir: dir.clone(),
                    controllers: controllers.clone(),
                });
            }
            let leaf = dir.join(id);
            steps.push(Step::Mkdir {
                path: leaf.clone(),
                leaf: true,
            });
            if let Some(m) = &limits.cpuset_mems {
                steps.push(write(leaf.join("cpuset.mems"), m.clone()));
            }
            if let Some(c) = &limits.cpuset_cpus {
                steps.push(write(leaf.join("cpuset.cpus"), c.clone()));
            }
            match (limits.cpu_quota_us, limits.cpu_period_us) {
                (Some(q), Some(p)) => steps.push(write(leaf.join("cpu.max"), format!("{q} {p}"))),
                (Some(q), None) => steps.push(write(leaf.join("cpu.max"), q.to_string())),
                (None, Some(p)) => steps.push(write(leaf.join("cpu.max"), format!("max {p}"))),
                (None, None) => {}
            }
            if let Some(m) = limits.memory_bytes {
                steps.push(write(leaf.join("memory.max"), m.to_string()));
            }
            if let Some(p) = limits.pids_max {
                steps.push(write(leaf.join("pids.max"), p.to_string()));
            }
            leaves.push(Leaf {
                controller: None,
                path: leaf,
            });
        }
    }
    Plan {
        version,
        steps,
        leaves,
    }
}

/// The cgroups of one jail.
#[derive(Debug, Clone)]
pub struct Cgroups {
    version: CgroupVersion,
    leaves: Vec<Leaf>,
    memory_limit: Option<u64>,
}

impl Cgroups {
    /// Creates the cgroups of jail `id` with `limits` (see the module docs
    /// for the layout). On v1 only controllers with a limit get a cgroup; on
    /// v2 the one cgroup is always created. A leftover, empty cgroup of the
    /// same id is reused. On error, leaves created so far are removed.
    pub fn create(
        root: &Path,
        parent: &Path,
        id: &str,
        limits: &CgroupLimits,
    ) -> Result<Self, CgroupError> {
        let version = detect_version(root)?;
        let plan = plan(version, root, parent, id, limits);
        let mut made = Vec::new();
        let result = plan.steps.iter().try_for_each(|s| run_step(s, &mut made));
        if let Err(e) = result {
            for dir in made.iter().rev() {
                let _ = fs::remove_dir(dir);
            }
            return Err(e);
        }
        Ok(Self {
            version,
            leaves: plan.leaves,
            memory_limit: limits.memory_bytes,
        })
    }

    /// Finds the existing cgroups of jail `id` (for clean-up): on v1 every
    /// mounted hierarchy under `root` is searched.
    pub fn existing(root: &Path, parent: &Path, id: &str) -> Result<Self, CgroupError> {
        let version = detect_version(root)?;
        let mut leaves = Vec::new();
        match version {
            CgroupVersion::V2 => {
                let path = root.join(parent).join(id);
                if path.is_dir() {
                    leaves.push(Leaf {
                        controller: None,
                        path,
                    });
                }
            }
            CgroupVersion::V1 => {
                let entries = fs::read_dir(root).map_err(|source| CgroupError::Read {
                    path: root.to_path_buf(),
                    source,
                })?;
                let mut seen = Vec::new();
                for entry in entries.flatten() {
                    let mount = entry.path();
                    // Skip aliases such as `cpu -> cpu,cpuacct`.
                    let Ok(ft) = entry.file_type() else { continue };
                    if !ft.is_dir() {
                        continue;
                    }
                    if crate::sys::fs_magic(&mount).ok() != Some(CGROUP_SUPER_MAGIC) {
                        continue;
                    }
                    let path = mount.join(parent).join(id);
                    if path.is_dir() && !seen.contains(&path) {
                        seen.push(path.clone());
                        leaves.push(Leaf {
                            controller: Some(entry.file_name().to_string_lossy().into_owned()),
                            path,
                        });
                    }
                }
            }
        }
        Ok(Self {
            version,
            leaves,
            memory_limit: None,
        })
    }

    /// The cgroup version in use.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The jail's cgroup directories.
    pub fn leaves(&self) -> &[Leaf] {
        &self.leaves
    }

    /// The memory limit these cgroups were created with.
    pub fn memory_limit(&self) -> Option<u64> {
        self.memory_limit
    }

    /// Moves process `pid` into every leaf (`cgroup.procs`).
    pub fn join(&self, pid: u32) -> Result<(), CgroupError> {
        for leaf in &self.leaves {
            write_file(&leaf.path.join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    /// The memory cgroup's OOM-kill counter (`oom_kill` in v1
    /// `memory.oom_control`, v2 `memory.events`), if there is one.
    pub fn oom_kills(&self) -> Option<u64> {
        let file = match self.version {
            CgroupVersion::V1 => self
                .leaves
                .iter()
                .find(|l| l.controller.as_deref() == Some("memory"))?
                .path
                .join("memory.oom_control"),
            CgroupVersion::V2 => self.leaves.first()?.path.join("memory.events"),
        };
        let text = fs::read_to_string(file).ok()?;
        parse_keyed(&text, "oom_kill")
    }

    /// The first leaf that still holds processes after waiting up to
    /// `grace` for it to empty (a just-exited process may not be reaped
    /// yet), with its pids. `None` when all are empty or gone.
    pub fn busy(&self, grace: Duration) -> Option<(PathBuf, String)> {
        let deadline = std::time::Instant::now() + grace;
        for leaf in &self.leaves {
            while let Ok(procs) = fs::read_to_string(leaf.path.join("cgroup.procs")) {
                let procs = procs.split_whitespace().collect::<Vec<_>>().join(" ");
                if procs.is_empty() {
                    break;
                }
                if std::time::Instant::now() >= deadline {
                    return Some((leaf.path.clone(), procs));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        None
    }

    /// Removes every leaf. Missing leaves are fine; a leaf that still holds
    /// processes (EBUSY) is retried for a short while (a just-exited process
    /// can take a moment to leave), then reported.
    pub fn remove(&self) -> Result<Vec<PathBuf>, CgroupError> {
        let mut removed = Vec::new();
        for leaf in &self.leaves {
            let mut tries = 0;
            loop {
                match fs::remove_dir(&leaf.path) {
                    Ok(()) => {
                        removed.push(leaf.path.clone());
                        break;
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) && tries < 50 => {
                        tries += 1;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(source) => {
                        return Err(CgroupError::Remove {
                            path: leaf.path.clone(),
                            source,
                        })
                    }
                }
            }
        }
        Ok(removed)
    }
}

/// Parses `key value` lines (as in `memory.events`, `memory.oom_control`).
pub(crate) fn parse_keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut it = line.split_whitespace();
        (it.next() == Some(key))
            .then(|| it.next()?.parse().ok())
            .flatten()
    })
}

fn read_file(path: &Path) -> Result<String, CgroupError> {
    fs::read_to_string(path).map_err(|source| CgroupError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn write_file(path: &Path, value: &str) -> Result<(), CgroupError> {
    fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|mut f| f.write_all(value.as_bytes()))
        .map_err(|source| CgroupError::Write {
            path: path.to_path_buf(),
            value: value.to_string(),
            source,
        })
}

fn run_step(step: &Step, made: &mut Vec<PathBuf>) -> Result<(), CgroupError> {
    match step {
        Step::CheckV1Mount { controller, path } => {
            if crate::sys::fs_magic(path).ok() != Some(CGROUP_SUPER_MAGIC) {
                return Err(CgroupError::ControllerNotMounted {
                    controller: controller.to_string(),
                    path: path.clone(),
                });
            }
        }
        Step::CheckV2Controllers { path, controllers } => {
            let available = read_file(path)?;
            let have: Vec<&str> = available.split_whitespace().collect();
            if let Some(missing) = controllers.iter().find(|c| !have.contains(c)) {
                return Err(CgroupError::ControllerUnavailable {
                    controller: missing.to_string(),
                    path: path.clone(),
                    available: available.trim().to_string(),
                });
            }
        }
        Step::EnableControllers { dir, controllers } => {
            let file = dir.join("cgroup.subtree_control");
            let enabled = read_file(&file)?;
            let enabled: Vec<&str> = enabled.split_whitespace().collect();
            for c in controllers.iter().filter(|c| !enabled.contains(c)) {
                write_file(&file, &format!("+{c}"))?;
            }
        }
        Step::Mkdir { path, leaf } => match fs::create_dir(path) {
            Ok(()) => {
                if *leaf {
                    made.push(path.clone());
                }
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                if *leaf {
                    let procs = read_file(&path.join("cgroup.procs"))?;
                    if !procs.trim().is_empty() {
                        return Err(CgroupError::InUse {
                            path: path.clone(),
                            procs: procs.split_whitespace().collect::<Vec<_>>().join(" "),
                        });
                    }
                }
            }
            Err(source) => {
                return Err(CgroupError::Mkdir {
                    path: path.clone(),
                    source,
                })
            }
        },
        Step::CopyIfEmpty { from, to } => {
            if read_file(to)?.trim().is_empty() {
                let value = read_file(from)?;
                write_file(to, value.trim())?;
            }
        }
        Step::Write { path, value } => write_file(path, value)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    fn writes(plan: &Plan) -> Vec<(String, String)> {
        plan.steps
            .iter()
            .filter_map(|s| match s {
                Step::Write { path, value } => Some((path.display().to_string(), value.clone())),
                _ => None,
            })
            .collect()
    }

    fn all_limits() -> CgroupLimits {
        CgroupLimits {
            cpu_quota_us: Some(50_000),
            cpu_period_us: Some(100_000),
            memory_bytes: Some(1 << 28),
            pids_max: Some(32),
            cpuset_cpus: Some("0-1".into()),
            cpuset_mems: None,
        }
    }

    #[test]
    fn v1_plan() {
        let plan = plan(
            CgroupVersion::V1,
            Path::new("/sys/fs/cgroup"),
            Path::new("ember"),
            "vm1",
            &all_limits(),
        );
        let leaves: Vec<_> = plan.leaves.iter().map(|l| l.path.clone()).collect();
        assert_eq!(
            leaves,
            [
                p("/sys/fs/cgroup/cpuset/ember/vm1"),
                p("/sys/fs/cgroup/cpu/ember/vm1"),
                p("/sys/fs/cgroup/memory/ember/vm1"),
                p("/sys/fs/cgroup/pids/ember/vm1"),
            ]
        );
        assert_eq!(
            writes(&plan),
            [
                (
                    "/sys/fs/cgroup/cpuset/ember/vm1/cpuset.cpus".into(),
                    "0-1".into()
                ),
                (
                    "/sys/fs/cgroup/cpu/ember/vm1/cpu.cfs_period_us".into(),
                    "100000".into()
                ),
                (
                    "/sys/fs/cgroup/cpu/ember/vm1/cpu.cfs_quota_us".into(),
                    "50000".into()
                ),
                (
                    "/sys/fs/cgroup/memory/ember/vm1/memory.limit_in_bytes".into(),
                    "268435456".into()
                ),
                ("/sys/fs/cgroup/pids/ember/vm1/pids.max".into(), "32".into()),
            ]
        );
        // The cpuset parent is initialised from the root, the leaf's mems
        // from the parent.
        assert!(plan.steps.contains(&Step::CopyIfEmpty {
            from: p("/sys/fs/cgroup/cpuset/cpuset.cpus"),
            to: p("/sys/fs/cgroup/cpuset/ember/cpuset.cpus"),
        }));
        assert!(plan.steps.contains(&Step::CopyIfEmpty {
            from: p("/sys/fs/cgroup/cpuset/ember/cpuset.mems"),
            to: p("/sys/fs/cgroup/cpuset/ember/vm1/cpuset.mems"),
        }));
        // mems are set before cpus on the leaf.
        let pos = |want: &Path| {
            plan.steps.iter().position(|s| match s {
                Step::Write { path, .. } | Step::CopyIfEmpty { to: path, .. } => path == want,
                _ => false,
            })
        };
        assert!(
            pos(Path::new("/sys/fs/cgroup/cpuset/ember/vm1/cpuset.mems"))
                < pos(Path::new("/sys/fs/cgroup/cpuset/ember/vm1/cpuset.cpus"))
        );
    }

    #[test]
    fn v1_only_needed_controllers() {
        let limits = CgroupLimits {
            pids_max: Some(8),
            ..Default::default()
        };
        let plan = plan(
            CgroupVersion::V1,
            Path::new("/cg"),
            Path::new("a/b"),
            "x",
            &limits,
        );
        assert_eq!(plan.leaves.len(), 1);
        assert_eq!(plan.leaves[0].path, p("/cg/pids/a/b/x"));
        assert_eq!(plan.leaves[0].controller.as_deref(), Some("pids"));
        let mkdirs: Vec<_> = plan
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Mkdir { path, leaf } => Some((path.clone(), *leaf)),
                _ => None,
            })
            .collect();
        assert_eq!(
            mkdirs,
            [
                (p("/cg/pids/a"), false),
                (p("/cg/pids/a/b"), false),
                (p("/cg/pids/a/b/x"), true)
            ]
        );
        let none = plan_v1_empty();
        assert!(none.leaves.is_empty() && none.steps.is_empty());
    }

    fn plan_v1_empty() -> Plan {
        plan(
            CgroupVersion::V1,
            Path::new("/cg"),
            Path::new("ember"),
            "x",
            &CgroupLimits::default(),
        )
    }

    #[test]
    fn v2_plan() {
        let plan = plan(
            CgroupVersion::V2,
            Path::new("/sys/fs/cgroup"),
            Path::new("ember"),
            "vm1",
            &all_limits(),
        );
        assert_eq!(plan.leaves.len(), 1);
        assert_eq!(plan.leaves[0].path, p("/sys/fs/cgroup/ember/vm1"));
        assert_eq!(
            writes(&plan),
            [
                ("/sys/fs/cgroup/ember/vm1/cpuset.cpus".into(), "0-1".into()),
                (
                    "/sys/fs/cgroup/ember/vm1/cpu.max".into(),
                    "50000 100000".into()
                ),
                (
                    "/sys/fs/cgroup/ember/vm1/memory.max".into(),
                    "268435456".into()
                ),
                ("/sys/fs/cgroup/ember/vm1/pids.max".into(), "32".into()),
            ]
        );
        let enables: Vec<_> = plan
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::EnableControllers { dir, controllers } => {
                    Some((dir.clone(), controllers.clone()))
                }
                _ => None,
            })
            .collect();
        let all = vec!["cpuset", "cpu", "memory", "pids"];
        assert_eq!(
            enables,
            [
                (p("/sys/fs/cgroup"), all.clone()),
                (p("/sys/fs/cgroup/ember"), all)
            ]
        );
    }

    #[test]
    fn v2_cpu_max_forms() {
        let mk = |q, per| {
            let l = CgroupLimits {
                cpu_quota_us: q,
                cpu_period_us: per,
                ..Default::default()
            };
            writes(&plan(
                CgroupVersion::V2,
                Path::new("/c"),
                Path::new("e"),
                "i",
                &l,
            ))
        };
        assert_eq!(
            mk(Some(2000), None),
            [("/c/e/i/cpu.max".into(), "2000".into())]
        );
        assert_eq!(
            mk(None, Some(5000)),
            [("/c/e/i/cpu.max".into(), "max 5000".into())]
        );
    }

    #[test]
    fn v2_without_limits_still_makes_the_group() {
        let plan = plan(
            CgroupVersion::V2,
            Path::new("/c"),
            Path::new("ember"),
            "i",
            &CgroupLimits::default(),
        );
        assert_eq!(plan.leaves[0].path, p("/c/ember/i"));
        assert!(!plan
            .steps
            .iter()
            .any(|s| matches!(s, Step::EnableControllers { .. } | Step::Write { .. })));
    }

    #[test]
    fn keyed_files() {
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(parse_keyed(v1, "oom_kill"), Some(3));
        assert_eq!(parse_keyed(v1, "under_oom"), Some(0));
        let v2 = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(parse_keyed(v2, "oom_kill"), Some(1));
        assert_eq!(parse_keyed("", "oom_kill"), None);
        assert_eq!(parse_keyed("oom_kill x", "oom_kill"), None);
    }

    #[test]
    fn steps_on_plain_files() {
        // The executor only needs files: exercise it on a scratch tree.
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::write(root.join("cpuset.cpus"), "0-1\n").unwrap();
        fs::create_dir(root.join("child")).unwrap();
        fs::write(root.join("child/cpuset.cpus"), "").unwrap();
        let mut made = Vec::new();
        run_step(
            &Step::CopyIfEmpty {
                from: root.join("cpuset.cpus"),
                to: root.join("child/cpuset.cpus"),
            },
            &mut made,
        )
        .unwrap();
        assert_eq!(
            fs::read_to_string(root.join("child/cpuset.cpus")).unwrap(),
            "0-1"
        );
        // An existing leaf with processes is refused.
        fs::write(root.join("child/cgroup.procs"), "42\n").unwrap();
        let e = run_step(
            &Step::Mkdir {
                path: root.join("child"),
                leaf: true,
            },
            &mut made,
        )
        .unwrap_err();
        assert!(matches!(e, CgroupError::InUse { .. }), "{e}");
        // v2 controller check names what is missing.
        fs::write(root.join("cgroup.controllers"), "cpu io\n").unwrap();
        let e = run_step(
            &Step::CheckV2Controllers {
                path: root.join("cgroup.controllers"),
                controllers: vec!["cpu", "memory"],
            },
            &mut made,
        )
        .unwrap_err();
        assert!(e.to_string().contains("`memory`"), "{e}");
        // A write to a missing file names the file and the value.
        let e = write_file(&root.join("nope/pids.max"), "5").unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("pids.max") && msg.contains("\"5\""), "{msg}");
        assert!(made.is_empty());
    }

    #[test]
    fn detect_on_non_cgroup_dir_is_v1_layout() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(detect_version(dir.path()).unwrap(), CgroupVersion::V1);
        assert!(detect_version(&dir.path().join("missing")).is_err());
    }
}

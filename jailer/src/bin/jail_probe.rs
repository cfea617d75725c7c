//! `jail-probe`: a stand-in "VMM" for the jailer's integration tests.
//!
//! Runs its arguments as commands, in order, printing `key=value` lines:
//! `report`, `read PATH`, `write PATH`, `fork N`, `alloc MIB`, `wait`
//! (blocks until a line or EOF on stdin; SIGTERM exits 42), `exit N`.
//! Errors are printed as `err:ERRNO`.

use std::io::{self, BufRead, Read, Write};

fn res<T>(r: io::Result<T>) -> String {
    match r {
        Ok(_) => "ok".to_string(),
        Err(e) => format!("err:{}", e.raw_os_error().unwrap_or(-1)),
    }
}

fn ids() -> (String, String) {
    let (mut ru, mut eu, mut su) = (0, 0, 0);
    let (mut rg, mut eg, mut sg) = (0, 0, 0);
    // SAFETY: valid pointers to uid_t/gid_t locals.
    unsafe {
        libc::getresuid(&mut ru, &mut eu, &mut su);
    }
    // SAFETY: as above.
    unsafe {
        libc::getresgid(&mut rg, &mut eg, &mut sg);
    }
    (format!("{ru}/{eu}/{su}"), format!("{rg}/{eg}/{sg}"))
}

fn list_dir(path: &str) -> String {
    match std::fs::read_dir(path) {
        Ok(rd) => {
            let mut names: Vec<String> = rd
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names.join(",")
        }
        Err(e) => res::<()>(Err(e)),
    }
}

fn devices() -> String {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    for p in [
        "/dev/kvm",
        "/dev/net/tun",
        "/dev/urandom",
        "/dev/userfaultfd",
    ] {
        if let Ok(m) = std::fs::symlink_metadata(p) {
            let rdev = m.rdev();
            out.push(format!(
                "{p}:{:o}:{}:{}:{}:{}",
                m.mode() & 0o7777,
                m.uid(),
                m.gid(),
                libc::major(rdev),
                libc::minor(rdev)
            ));
        }
    }
    out.join(";")
}

fn open_fds() -> String {
    let mut fds = Vec::new();
    for fd in 0..1024 {
        // SAFETY: F_GETFD only reads descriptor flags.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } != -1 {
            fds.push(fd.to_string());
        }
    }
    fds.join(",")
}

fn rlimit(res: libc::__rlimit_resource_t) -> String {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `rl` is a valid rlimit to fill.
    unsafe { libc::getrlimit(res, &mut rl) };
    let f = |v: libc::rlim_t| {
        if v == libc::RLIM_INFINITY {
            "unlimited".to_string()
        } else {
            v.to_string()
        }
    };
    format!("{}:{}", f(rl.rlim_cur), f(rl.rlim_max))
}

/// KVM_GET_API_VERSION, then KVM_CREATE_VM: `12,vm` when KVM is usable.
fn kvm_check() -> String {
    use std::os::fd::AsRawFd;
    const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;
    const KVM_CREATE_VM: libc::c_ulong = 0xAE01;
    let kvm = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(f) => f,
        Err(e) => return res::<()>(Err(e)),
    };
    // SAFETY: KVM_GET_API_VERSION takes no argument.
    let api = unsafe { libc::ioctl(kvm.as_raw_fd(), KVM_GET_API_VERSION, 0) };
    // SAFETY: KVM_CREATE_VM takes the machine type (0) by value.
    let vm = unsafe { libc::ioctl(kvm.as_raw_fd(), KVM_CREATE_VM, 0) };
    let vm = if vm >= 0 {
        // SAFETY: `vm` is a descriptor KVM just returned to us.
        unsafe { libc::close(vm) };
        "vm".to_string()
    } else {
        res::<()>(Err(io::Error::last_os_error()))
    };
    format!("{api},{vm}")
}

fn report() {
    let (uid, gid) = ids();
    println!("uid={uid}");
    println!("gid={gid}");
    // SAFETY: size 0 only queries the count.
    println!("groups={}", unsafe {
        libc::getgroups(0, std::ptr::null_mut())
    });
    println!("pid={}", std::process::id());
    println!("root={}", list_dir("/"));
    println!("devices={}", devices());
    println!("hostfile={}", res(std::fs::File::open("/etc/hostname")));
    println!("hostroot={}", res(std::fs::metadata("/usr/bin")));
    println!(
        "kvm={}",
        res(std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm"))
    );
    println!("kvm_api={}", kvm_check());
    let mut buf = [0u8; 16];
    println!(
        "urandom={}",
        res(std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut buf)))
    );
    // SAFETY: PR_GET_NO_NEW_PRIVS takes no pointers.
    println!("nnp={}", unsafe {
        libc::prctl(libc::PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0)
    });
    // SAFETY: setuid takes a plain id; it must fail in a jail.
    let su = unsafe { libc::setuid(0) };
    println!(
        "setuid0={}",
        if su == 0 {
            "ok".into()
        } else {
            res::<()>(Err(io::Error::last_os_error()))
        }
    );
    let env: Vec<String> = std::env::vars().map(|(k, v)| format!("{k}={v}")).collect();
    println!("env={}", env.join(";"));
    println!("fds={}", open_fds());
    println!("nofile={}", rlimit(libc::RLIMIT_NOFILE));
    println!("fsize={}", rlimit(libc::RLIMIT_FSIZE));
    match std::fs::read_to_string("/proc/self/cgroup") {
        Ok(s) => println!("cgroup={}", s.trim().replace('\n', ";")),
        Err(e) => println!("cgroup={}", res::<()>(Err(e))),
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    for key in ["SigIgn", "SigBlk", "CapEff", "NoNewPrivs"] {
        let v = status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}:")))
            .map_or("-".to_string(), |v| v.trim().to_string());
        println!("{}={v}", key.to_ascii_lowercase());
    }
    match std::fs::read_link("/proc/self/ns/net") {
        Ok(l) => println!("netns={}", l.display()),
        Err(e) => println!("netns={}", res::<()>(Err(e))),
    }
    println!(
        "proc={}",
        list_dir("/proc")
            .split(',')
            .filter(|n| !n.bytes().all(|b| b.is_ascii_digit()))
            .collect::<Vec<_>>()
            .join(",")
    );
}

fn fork_children(n: usize) {
    let mut kids = Vec::new();
    let mut err = String::from("none");
    for _ in 0..n {
        // SAFETY: the probe is single-threaded; the child only pauses.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            loop {
                // SAFETY: pause has no preconditions.
                unsafe { libc::pause() };
            }
        }
        if pid < 0 {
            err = format!(
                "{}",
                io::Error::last_os_error().raw_os_error().unwrap_or(-1)
            );
            break;
        }
        kids.push(pid);
    }
    println!("forked={} of={n} err={err}", kids.len());
    for pid in kids {
        // SAFETY: killing and reaping our own children.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
        let mut st = 0;
        // SAFETY: `st` is a valid int.
        unsafe { libc::waitpid(pid, &mut st, 0) };
    }
}

extern "C" fn on_term(_: libc::c_int) {
    // SAFETY: _exit is async-signal-safe.
    unsafe { libc::_exit(42) };
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    let out = io::stdout();
    while let Some(cmd) = it.next() {
        let mut arg = || it.next().cloned().unwrap_or_default();
        match cmd.as_str() {
            "report" => report(),
            "read" => {
                let p = arg();
                println!("read:{p}={}", res(std::fs::read(&p)));
            }
            "write" => {
                let p = arg();
                let r = std::fs::OpenOptions::new()
                    .append(true)
                    .open(&p)
                    .and_then(|mut f| f.write_all(b"x"));
                println!("write:{p}={}", res(r));
            }
            "create" => {
                let p = arg();
                println!("create:{p}={}", res(std::fs::write(&p, b"new")));
            }
            "fork" => fork_children(arg().parse().unwrap_or(0)),
            "alloc" => {
                let mib: usize = arg().parse().unwrap_or(0);
                let mut v: Vec<u8> = Vec::with_capacity(mib << 20);
                // Touch every page so it is really charged.
                v.resize(mib << 20, 1);
                println!(
                    "alloc={} sum={}",
                    mib,
                    v.iter().step_by(4096).map(|&b| b as u64).sum::<u64>()
                );
            }
            "wait" => {
                // SAFETY: installing a handler that only calls _exit.
                unsafe { libc::signal(libc::SIGTERM, on_term as *const () as libc::sighandler_t) };
                println!("waiting pid={}", std::process::id());
                let _ = out.lock().flush();
                let mut line = String::new();
                let _ = io::stdin().lock().read_line(&mut line);
            }
            "exit" => std::process::exit(arg().parse().unwrap_or(0)),
            other => println!("unknown={other}"),
        }
        let _ = out.lock().flush();
    }
}

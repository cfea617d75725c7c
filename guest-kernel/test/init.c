// Test init for the ember guest kernel under QEMU TCG (run by qemu-check.sh).
// Exercises: syscalls via the entry_SYSCALL_64 page-fault path (patch 0003),
// signal delivery + restart from that path, /dev/port, cgroup2 controllers,
// overlayfs on tmpfs, socket families, misc fds. Prints PASS/FAIL lines.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/timerfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <linux/vm_sockets.h>

static uintptr_t entry; // address of entry_SYSCALL_64
static int fails;

static void check(int ok, const char *what) {
    printf("%s %s\n", ok ? "PASS" : "FAIL", what);
    fflush(stdout);
    if (!ok) fails++;
}

// Do a system call by jumping to entry_SYSCALL_64 in user mode, like the
// kvm_pvm host does: rcx = return address (right after a 2-byte syscall
// instruction, so a restart re-executes a real syscall), rax = number.
static long fault_syscall(long nr, long a1, long a2, long a3) {
    long ret;
    register long r10 asm("r10") = 0;
    asm volatile(
        "lea 1f(%%rip), %%rcx\n\t"
        "jmp *%[entry]\n\t"
        "syscall\n\t" /* restart target: rcx - 2 */
        "1:\n\t"
        : "=a"(ret)
        : "a"(nr), "D"(a1), "S"(a2), "d"(a3), "r"(r10), [entry] "r"(entry)
        : "rcx", "r11", "memory");
    return ret;
}

static volatile int alarms;
static void on_alarm(int sig) { (void)sig; alarms++; }

static int read_file(const char *path, char *buf, size_t n) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return -1;
    ssize_t r = read(fd, buf, n - 1);
    close(fd);
    if (r < 0) return -1;
    buf[r] = 0;
    return (int)r;
}

int main(void) {
    char buf[512];
    printf("ember-test-init: pid %d\n", getpid());
    fflush(stdout);

    FILE *f = fopen("/entry", "r");
    if (!f || fscanf(f, "%lx", &entry) != 1) { printf("no /entry\n"); goto out; }
    fclose(f);

    // 1. simple calls via the fault path
    check(fault_syscall(SYS_getpid, 0, 0, 0) == getpid(), "fault-path getpid");
    const char msg[] = "hello via entry_SYSCALL_64 fault\n";
    check(fault_syscall(SYS_write, 1, (long)msg, sizeof msg - 1) == sizeof msg - 1, "fault-path write");
    check(fault_syscall(-1, 0, 0, 0) == -ENOSYS, "fault-path bad nr gives ENOSYS");
    struct timespec ts = {0, 30 * 1000 * 1000}, t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long r = fault_syscall(SYS_nanosleep, (long)&ts, 0, 0);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    long ms = (t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000;
    check(r == 0 && ms >= 30, "fault-path nanosleep blocks and returns");

    // 2. signal during a blocking fault-path read, with SA_RESTART: restart
    //    goes through the real syscall instruction at rcx-2.
    int p[2];
    pipe(p);
    pid_t child = fork();
    if (child == 0) { usleep(200 * 1000); write(p[1], "x", 1); _exit(0); }
    struct sigaction sa = {0};
    sa.sa_handler = on_alarm;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGALRM, &sa, NULL);
    struct itimerval it = {{0, 0}, {0, 50 * 1000}};
    setitimer(ITIMER_REAL, &it, NULL);
    char c = 0;
    r = fault_syscall(SYS_read, p[0], (long)&c, 1);
    check(r == 1 && c == 'x' && alarms == 1, "fault-path read: signal handler ran, SA_RESTART restarted");
    waitpid(child, NULL, 0);
    //    without SA_RESTART: EINTR
    sa.sa_flags = 0;
    sigaction(SIGALRM, &sa, NULL);
    setitimer(ITIMER_REAL, &it, NULL);
    r = fault_syscall(SYS_read, p[0], (long)&c, 1);
    check(r == -EINTR && alarms == 2, "fault-path read: EINTR without SA_RESTART");
    //    exit through the fault path in a child
    child = fork();
    if (child == 0) fault_syscall(SYS_exit, 42, 0, 0);
    int st = 0;
    waitpid(child, &st, 0);
    check(WIFEXITED(st) && WEXITSTATUS(st) == 42, "fault-path exit(42) in a child");

    // 3. /dev/port (devtmpfs is mounted on /dev by the kernel)
    int fd = open("/dev/port", O_RDWR);
    unsigned char b = 0;
    check(fd >= 0 && pread(fd, &b, 1, 0x3f8 + 5) == 1 && (b & 0x20), "/dev/port read UART LSR");
    b = 0x42;
    check(fd >= 0 && pwrite(fd, &b, 1, 0x80) == 1, "/dev/port write port 0x80");
    close(fd);

    // 4. proc, sysfs, cgroup2
    mkdir("/proc", 0755); mkdir("/sys", 0755);
    check(mount("proc", "/proc", "proc", 0, NULL) == 0, "mount proc");
    check(mount("sysfs", "/sys", "sysfs", 0, NULL) == 0, "mount sysfs");
    check(access("/sys/kernel/slab", F_OK) != 0, "no /sys/kernel/slab (patch 0008)");
    check(access("/sys/module/printk/parameters", F_OK) != 0, "no /sys/module/*/parameters (patch 0004)");
    check(mount("cgroup2", "/sys/fs/cgroup", "cgroup2", 0, NULL) == 0, "mount cgroup2");
    check(read_file("/sys/fs/cgroup/cgroup.controllers", buf, sizeof buf) > 0 &&
          strstr(buf, "cpu") && strstr(buf, "memory") && strstr(buf, "pids"), "cgroup controllers cpu memory pids");
    printf("  cgroup.controllers: %s", buf);

    // 5. tmpfs + overlayfs (tmpfs upper needs xattrs)
    mkdir("/tmp", 0755);
    check(mount("tmpfs", "/tmp", "tmpfs", 0, "size=8m") == 0, "mount tmpfs");
    mkdir("/tmp/u", 0755); mkdir("/tmp/w", 0755); mkdir("/tmp/m", 0755);
    check(mount("overlay", "/tmp/m", "overlay", 0, "lowerdir=/,upperdir=/tmp/u,workdir=/tmp/w") == 0, "mount overlay (ext4 lower, tmpfs upper)");
    fd = open("/tmp/m/new-file", O_CREAT | O_WRONLY, 0644);
    check(fd >= 0 && write(fd, "ok", 2) == 2, "write through overlay");
    close(fd);
    check(access("/tmp/u/new-file", F_OK) == 0, "copy-up landed in upper dir");

    // 6. sockets and fd types
    int s = socket(AF_VSOCK, SOCK_STREAM, 0);
    check(s >= 0, "socket(AF_VSOCK)"); close(s);
    s = socket(AF_INET, SOCK_STREAM, 0);
    check(s >= 0, "socket(AF_INET)"); close(s);
    int sv[2];
    check(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair(AF_UNIX)");
    check(epoll_create1(0) >= 0, "epoll_create1");
    check(eventfd(0, 0) >= 0, "eventfd");
    check(timerfd_create(CLOCK_MONOTONIC, 0) >= 0, "timerfd_create");
    sigset_t set; sigemptyset(&set); sigaddset(&set, SIGUSR1);
    check(signalfd(-1, &set, 0) >= 0, "signalfd");
    check(inotify_init1(0) >= 0, "inotify_init1");
    check(memfd_create("x", 0) >= 0, "memfd_create");
    check(syscall(SYS_io_setup, 8, &(unsigned long){0}) == 0, "io_setup (AIO)");
    fd = open("/tmp/lockfile", O_CREAT | O_RDWR, 0644);
    check(flock(fd, LOCK_EX) == 0, "flock");
    check(read_file("/proc/sys/kernel/osrelease", buf, sizeof buf) > 0, "proc sysctl");
    printf("  osrelease: %s", buf);
    void *pg = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    check(pg != MAP_FAILED && madvise(pg, 4096, MADV_DONTNEED) == 0, "madvise");

out:
    printf("ember-test-init: %s (%d failures)\n", fails ? "FAILED" : "ALL PASSED", fails);
    fflush(stdout);
    sync();
    reboot(RB_AUTOBOOT);
    return 0;
}

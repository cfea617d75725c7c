//! Loading a Linux kernel and preparing the 64-bit boot protocol state.
//!
//! Two image formats: an ELF `vmlinux` (entered at its ELF entry point, `startup_64`) and a
//! `bzImage` (entered at the 64-bit entry, 0x200 past the protected-mode code). Both boot with
//! the Linux 64-bit boot protocol: paging on with an identity map, `rsi` pointing at
//! `boot_params`, and the command line and e820 map filled in by us.

pub mod mptable;
pub mod regs;

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use linux_loader::cmdline::Cmdline;
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::boot_params;
use linux_loader::loader::{BzImage, Elf, KernelLoader};
use vm_memory::{ByteValued, GuestAddress};

use ember_devices::GuestMemoryMmap;

use crate::memory::{e820_map, CMDLINE_MAX_SIZE, CMDLINE_START, HIMEM_START, ZERO_PAGE_START};

/// Errors loading a kernel.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The kernel file cannot be read.
    #[error("cannot read kernel {path}: {source}")]
    Read {
        /// The kernel file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Neither an ELF vmlinux nor a bzImage.
    #[error("{path} is not a Linux kernel: expected an ELF vmlinux or a bzImage ({detail})")]
    NotAKernel {
        /// The file.
        path: PathBuf,
        /// What was found.
        detail: String,
    },
    /// linux-loader refused the image.
    #[error("cannot load kernel {path}: {source}")]
    Load {
        /// The kernel file.
        path: PathBuf,
        /// Why.
        source: linux_loader::loader::Error,
    },
    /// Command line problems.
    #[error("kernel command line: {0}")]
    Cmdline(String),
    /// Writing boot structures to guest memory failed.
    #[error("cannot write {what} into guest memory: {detail}")]
    Write {
        /// Which structure.
        what: &'static str,
        /// Why.
        detail: String,
    },
}

/// Kernel image formats ember boots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelFormat {
    /// ELF vmlinux.
    Elf,
    /// bzImage.
    BzImage,
}

/// Where the kernel went and how to enter it.
#[derive(Debug, Clone, Copy)]
pub struct LoadedKernel {
    /// The image format.
    pub format: KernelFormat,
    /// 64-bit entry point (guest physical).
    pub entry: GuestAddress,
    /// The setup header to start `boot_params` from (bzImage only).
    pub setup_header: Option<linux_loader::loader::bootparam::setup_header>,
}

/// Tells an ELF from a bzImage by their magic numbers.
pub fn detect_format(path: &Path, file: &mut File) -> Result<KernelFormat, BootError> {
    let read_err = |source| BootError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut head = [0u8; 0x210];
    file.seek(SeekFrom::Start(0)).map_err(read_err)?;
    let n = read_up_to(file, &mut head).map_err(read_err)?;
    file.seek(SeekFrom::Start(0)).map_err(read_err)?;
    if n >= 4 && head[..4] == *b"\x7fELF" {
        return Ok(KernelFormat::Elf);
    }
    // bzImage: "HdrS" at 0x202 and the 0xAA55 boot flag at 0x1fe.
    if n >= 0x206 && head[0x202..0x206] == *b"HdrS" && head[0x1fe..0x200] == [0x55, 0xaa] {
        return Ok(KernelFormat::BzImage);
    }
    Err(BootError::NotAKernel {
        path: path.to_path_buf(),
        detail: if n == 0 {
            "the file is empty".into()
        } else {
            format!("first bytes {:02x?}", &head[..n.min(8)])
        },
    })
}

fn read_up_to(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Loads the kernel at `path` into `mem`.
pub fn load_kernel(mem: &GuestMemoryMmap, path: &Path) -> Result<LoadedKernel, BootError> {
    let mut file = File::open(path).map_err(|source| BootError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let format = detect_format(path, &mut file)?;
    let load_err = |source| BootError::Load {
        path: path.to_path_buf(),
        source,
    };
    match format {
        KernelFormat::Elf => {
            let r = Elf::load(mem, None, &mut file, Some(GuestAddress(HIMEM_START)))
                .map_err(load_err)?;
            Ok(LoadedKernel {
                format,
                entry: r.kernel_load,
                setup_header: None,
            })
        }
        KernelFormat::BzImage => {
            let r = BzImage::load(mem, None, &mut file, Some(GuestAddress(HIMEM_START)))
                .map_err(load_err)?;
            Ok(LoadedKernel {
                format,
                // The 64-bit entry point sits 0x200 past the start of the protected-mode code.
                entry: GuestAddress(r.kernel_load.0 + 0x200),
                setup_header: r.setup_header,
            })
        }
    }
}

/// `boot_params` as a plain-old-data value vm-memory can write.
#[derive(Clone, Copy, Default)]
#[repr(transparent)]
struct BootParamsPod(boot_params);
// SAFETY: `boot_params` is a `repr(C, packed)` struct of integers and arrays of integers
// generated from the kernel's UAPI header; every bit pattern is valid and it has no padding
// that could leak uninitialised bytes (packed).
unsafe impl ByteValued for BootParamsPod {}

/// The loader id ember reports (0xff: "undefined" boot loader, per the boot protocol).
const LOADER_TYPE_UNDEFINED: u8 = 0xff;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_MIN_ALIGNMENT: u32 = 0x0100_0000;

/// Builds a command line from a string, checking the size.
pub fn build_cmdline(s: &str) -> Result<Cmdline, BootError> {
    let mut c = Cmdline::new(CMDLINE_MAX_SIZE).map_err(|e| BootError::Cmdline(e.to_string()))?;
    c.insert_str(s)
        .map_err(|e| BootError::Cmdline(format!("{e} (command line {s:?})")))?;
    Ok(c)
}

/// Writes the command line and `boot_params` (with the e820 map) into guest memory.
pub fn write_boot_params(
    mem: &GuestMemoryMmap,
    kernel: &LoadedKernel,
    cmdline: &Cmdline,
    mem_bytes: u64,
) -> Result<(), BootError> {
    linux_loader::loader::load_cmdline(mem, GuestAddress(CMDLINE_START), cmdline).map_err(|e| {
        BootError::Write {
            what: "the command line",
            detail: e.to_string(),
        }
    })?;
    let cmdline_len = cmdline
        .as_cstring()
        .map_err(|e| BootError::Cmdline(e.to_string()))?
        .as_bytes_with_nul()
        .len();

    let mut params = boot_params::default();
    if let Some(hdr) = kernel.setup_header {
        params.hdr = hdr;
    }
    params.hdr.type_of_loader = LOADER_TYPE_UNDEFINED;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT;
    let map = e820_map(mem_bytes);
    if map.len() > params.e820_table.len() {
        return Err(BootError::Write {
            what: "the e820 map",
            detail: format!("{} entries do not fit", map.len()),
        });
    }
    for (i, (addr, size, kind)) in map.iter().enumerate() {
        params.e820_table[i].addr = *addr;
        params.e820_table[i].size = *size;
        params.e820_table[i].r#type = *kind;
    }
    params.e820_entries = map.len() as u8;

    let bp = BootParams::new(&BootParamsPod(params), GuestAddress(ZERO_PAGE_START));
    LinuxBootConfigurator::write_bootparams(&bp, mem).map_err(|e| BootError::Write {
        what: "boot_params",
        detail: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use vm_memory::Bytes;

    #[test]
    fn refuses_files_that_are_not_kernels() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(b"#!/bin/sh\necho not a kernel\n").unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap();
        let e = load_kernel(&mem, f.path()).unwrap_err();
        assert!(matches!(e, BootError::NotAKernel { .. }), "{e}");
        assert!(e.to_string().contains("not a Linux kernel"));
        let empty = tempfile::NamedTempFile::new().unwrap();
        let e = load_kernel(&mem, empty.path()).unwrap_err();
        assert!(e.to_string().contains("empty"), "{e}");
        let e = load_kernel(&mem, Path::new("/nonexistent/vmlinux")).unwrap_err();
        assert!(matches!(e, BootError::Read { .. }));
    }

    #[test]
    fn truncated_elf_is_a_load_error_not_a_panic() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(b"\x7fELF\x02\x01\x01").unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap();
        assert!(matches!(
            load_kernel(&mem, f.path()),
            Err(BootError::Load { .. })
        ));
    }

    #[test]
    fn boot_params_carry_cmdline_and_e820() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap();
        let k = LoadedKernel {
            format: KernelFormat::Elf,
            entry: GuestAddress(0x100_0000),
            setup_header: None,
        };
        let c = build_cmdline("console=ttyS0 panic=1").unwrap();
        write_boot_params(&mem, &k, &c, 64 << 20).unwrap();
        let mut s = [0u8; 22];
        mem.read_slice(&mut s, GuestAddress(CMDLINE_START)).unwrap();
        assert_eq!(&s, b"console=ttyS0 panic=1\0");
        let bp: BootParamsPod = mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        let p = bp.0;
        assert_eq!({ p.hdr.header }, KERNEL_HDR_MAGIC);
        assert_eq!({ p.hdr.cmd_line_ptr }, CMDLINE_START as u32);
        assert_eq!(p.e820_entries, 3);
        let last = p.e820_table[2];
        assert_eq!(
            ({ last.addr }, { last.size }),
            (HIMEM_START, (64 << 20) - HIMEM_START)
        );
    }

    #[test]
    fn oversized_cmdline_is_refused() {
        let long = "x".repeat(CMDLINE_MAX_SIZE + 1);
        assert!(matches!(build_cmdline(&long), Err(BootError::Cmdline(_))));
    }
}

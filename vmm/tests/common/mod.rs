//! Helpers shared by the VMM's integration tests.

/// Where the hand-assembled guests are loaded (guest physical, above 1 MiB).
pub const LOAD_ADDR: u64 = 0x20_0000;

/// A minimal ELF64 executable whose single segment holds `code`, entered at its first byte.
pub fn elf_with_code(code: &[u8]) -> Vec<u8> {
    let code_off: u64 = 64 + 56;
    let total = code_off + code.len() as u64;
    let mut e = Vec::new();
    e.extend_from_slice(b"\x7fELF");
    e.extend_from_slice(&[2, 1, 1, 0]); // 64-bit, little endian, version 1, SysV
    e.extend_from_slice(&[0; 8]);
    e.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e.extend_from_slice(&0x3eu16.to_le_bytes()); // x86-64
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&(LOAD_ADDR + code_off).to_le_bytes()); // entry
    e.extend_from_slice(&64u64.to_le_bytes()); // phoff
    e.extend_from_slice(&0u64.to_le_bytes()); // shoff
    e.extend_from_slice(&0u32.to_le_bytes()); // flags
    e.extend_from_slice(&64u16.to_le_bytes()); // ehsize
    e.extend_from_slice(&56u16.to_le_bytes()); // phentsize
    e.extend_from_slice(&1u16.to_le_bytes()); // phnum
    e.extend_from_slice(&[0; 6]); // shentsize, shnum, shstrndx
                                  // PT_LOAD, R+X, the whole file at LOAD_ADDR.
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&5u32.to_le_bytes());
    e.extend_from_slice(&0u64.to_le_bytes());
    e.extend_from_slice(&LOAD_ADDR.to_le_bytes());
    e.extend_from_slice(&LOAD_ADDR.to_le_bytes());
    e.extend_from_slice(&total.to_le_bytes());
    e.extend_from_slice(&total.to_le_bytes());
    e.extend_from_slice(&0x1000u64.to_le_bytes());
    e.extend_from_slice(code);
    e
}

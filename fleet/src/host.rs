//! This host as the fleet sees it: what a snapshot made here needs of the host it is restored
//! on.

/// This host's kind (`kvm_pvm` or `kvm`) and the CPU profile its snapshots are made with: a
/// snapshot restores only on a host where both are the same.
pub fn profile() -> (String, String) {
    let kvm = ember_vmm::cpu::HostKvm::detect();
    let kind = match kvm {
        ember_vmm::cpu::HostKvm::Pvm => "kvm_pvm",
        ember_vmm::cpu::HostKvm::Hardware => "kvm",
    };
    (
        kind.to_string(),
        format!("{:?}", kvm.default_profile()).to_lowercase(),
    )
}

//! The [`Persist`] trait: how a component saves its state into a snapshot and is rebuilt from it.

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Save and restore of one component (a device, the interrupt controller, the VM itself).
///
/// Each component implements this next to its own code, with its own `*State` type. `save`
/// captures everything the component needs to resume; `restore` rebuilds the component from
/// that state plus the live resources the state cannot hold (guest memory, an event fd, a file
/// handle), passed as `ConstructorArgs`.
///
/// The state is read back from a file that may be damaged or hostile even after its checksum
/// passes (a buggy or older writer), so `restore` must validate it (ranges, indices, sizes
/// against guest memory) and return an error rather than panic.
///
/// Compatibility: the state is encoded with bincode (see [`crate::state`]), which is not
/// self-describing. Changing a `State` type (adding, removing or reordering fields) changes the
/// format; such a change needs a new [`FORMAT_VERSION`](crate::FORMAT_VERSION).
///
/// ```
/// use ember_snapshot::{decode_state, encode_state, Persist};
/// use serde::{Deserialize, Serialize};
///
/// struct Serial {
///     irq: u32,
///     scratch: u8,
/// }
///
/// #[derive(Serialize, Deserialize)]
/// struct SerialState {
///     scratch: u8,
/// }
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("serial: invalid state")]
/// struct SerialError;
///
/// impl Persist for Serial {
///     type State = SerialState;
///     type ConstructorArgs = u32; // the IRQ, wired by the VMM, not stored
///     type Error = SerialError;
///
///     fn save(&self) -> SerialState {
///         SerialState { scratch: self.scratch }
///     }
///
///     fn restore(irq: u32, state: &SerialState) -> Result<Self, SerialError> {
///         Ok(Serial { irq, scratch: state.scratch })
///     }
/// }
///
/// let bytes = encode_state(&Serial { irq: 4, scratch: 7 }.save()).unwrap();
/// let serial = Serial::restore(4, &decode_state(&bytes).unwrap()).unwrap();
/// assert_eq!((serial.irq, serial.scratch), (4, 7));
/// ```
pub trait Persist: Sized {
    /// The serializable snapshot of this component.
    type State: Serialize + DeserializeOwned;
    /// What `restore` needs besides the state: live resources owned by the caller.
    type ConstructorArgs;
    /// Why a restore failed (typically: the state is inconsistent).
    type Error: std::error::Error;

    /// Capture the component's state. Called while the VM is paused.
    fn save(&self) -> Self::State;

    /// Rebuild the component from `state` and `args`.
    ///
    /// # Errors
    /// When `state` is invalid or a resource in `args` does not match it.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    /// A toy device with a queue index that must stay below its size.
    #[derive(Debug, PartialEq)]
    struct Queue {
        size: u16,
        next: u16,
        mem_len: u64,
    }

    #[derive(Debug, Serialize, Deserialize)]
    struct QueueState {
        size: u16,
        next: u16,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("queue state: next index {next} is not below size {size}")]
    struct QueueError {
        size: u16,
        next: u16,
    }

    impl Persist for Queue {
        type State = QueueState;
        type ConstructorArgs = u64;
        type Error = QueueError;

        fn save(&self) -> QueueState {
            QueueState {
                size: self.size,
                next: self.next,
            }
        }

        fn restore(mem_len: u64, state: &QueueState) -> Result<Self, QueueError> {
            if state.next >= state.size {
                return Err(QueueError {
                    size: state.size,
                    next: state.next,
                });
            }
            Ok(Queue {
                size: state.size,
                next: state.next,
                mem_len,
            })
        }
    }

    #[test]
    fn save_restore_through_a_state_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state");
        let q = Queue {
            size: 256,
            next: 17,
            mem_len: 1 << 28,
        };
        crate::write_state(&path, &q.save()).expect("write");
        let state: QueueState = crate::read_state(&path).expect("read");
        assert_eq!(Queue::restore(1 << 28, &state).expect("restore"), q);
        let bad = QueueState { size: 4, next: 4 };
        assert!(Queue::restore(0, &bad).is_err());
    }
}

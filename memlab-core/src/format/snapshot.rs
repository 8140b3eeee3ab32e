//! PyTorch's memory snapshot: the pickle `torch.cuda.memory._dump_snapshot`
//! writes, read by pytorch.org/memory_viz, by `python -m
//! torch.cuda._memory_viz` and by every `memlab` command.

use super::{About, Contents, Cost, FileFormat, Input, Registered, Source, WrittenIn};
use crate::export::Snapshot;
use crate::Result;

/// `memlab_snapshot.pickle`: the recording as PyTorch's memory snapshot.
/// Reads memlab's and PyTorch's own as [`SnapshotFile`](crate::export::SnapshotFile).
pub struct SnapshotPickle;

inventory::submit! { Registered(&SnapshotPickle) }

impl FileFormat for SnapshotPickle {
    fn about(&self) -> &'static About {
        &About {
            name: "snapshot",
            description: "the PyTorch memory snapshot",
            recognised_by: Some("its first byte is 0x80"),
            extension: "pickle",
            stem: "memlab_snapshot",
            written_in: WrittenIn::BOTH,
            order: 10,
            made_from_recording: true,
        }
    }

    fn estimate(&self) -> u64 {
        Cost::SNAPSHOT.now()
    }

    fn write(&self, source: &dyn Source, out: &mut dyn std::io::Write) -> Result<()> {
        let bytes = source.snapshot()?.to_pickle()?;
        out.write_all(&bytes).map_err(|e| crate::Error::io("write the snapshot", e))
    }

    fn read(&self, input: &Input) -> Option<Result<Contents>> {
        // Every pickle of protocol 2 or later opens with 0x80; the reader
        // says what is wrong with one that is not a snapshot.
        (input.head().first() == Some(&0x80)).then(|| Snapshot::read_pickle(input.path()).map(Contents::new))
    }
}

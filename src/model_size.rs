//! How much memory a model needs, measured rather than estimated: parameters,
//! activations kept for backward, the peaks of forward (with and without
//! autograd), backward and a whole training step, and the state of common
//! optimizers, each from running the model once on a sample batch. (Whether
//! a batch fits is `batch_size`'s question.)

pub use crate::tools::model_size::{ModelSize, OptimizerSize};

//! Frames as a person reads them. A stack a recorder takes holds, around the
//! few frames of the program's own code, dozens of others: CPython's
//! interpreter, torch's Python package, libtorch's dispatcher, the C++
//! runtime, the recorder itself. PyTorch's `_record_memory_history()`
//! (its default, `stacks="all"`) gives about 60 of them to an allocation.
//!
//! [`FrameKind::of`] is the one classifier of frames every view uses: the
//! program's own frames are [`FrameKind::User`], and the rest say what they
//! are. From it, [`site`] names an allocation after its innermost frame of
//! the program's own, or, where it has none (autograd's backward pass runs on
//! a thread of libtorch's, with no Python frame), after what made it
//! ([`made_by`]); and [`fold`] turns a stack into the levels a call-stack
//! view shows, each run of frames that are not the program's own folded into
//! one marker that keeps them for whoever opens it.

use serde::Serialize;

use super::SnapshotFrame;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FrameKind {
    /// The program's own code: a Python file outside torch's package, the
    /// standard library and installed packages (`train.py`, a notebook's
    /// `<ipython-input-…>`), or a Rust file outside the standard library and
    /// the crates cargo fetched.
    User,
    /// Python code of torch's package (`torch/nn/modules/module.py`), the
    /// standard library or another installed package.
    PythonLibrary,
    /// Rust's standard library and the crates cargo fetched (tch among them).
    RustLibrary,
    /// CPython's interpreter in C (`_PyEval_EvalFrameDefault`, `PyObject_Call`).
    Interpreter,
    /// libtorch's dispatcher: an op's entry points (`at::_ops::…`), the
    /// kernel wrappers it calls through (`c10::impl::…`, `wrapper_CUDA_…`)
    /// and autograd's layer over them (`torch::autograd::VariableType::…`).
    Dispatcher,
    /// The rest of libtorch and torch's C++ (ATen's kernels, c10, the
    /// caching allocator, autograd's engine, torch's Python bindings).
    Libtorch,
    /// The recorder taking the stack (`torch::unwind::unwind`,
    /// `CapturedTraceback::gather`).
    Recorder,
    /// Other native code: the C and C++ runtimes (a thread's start,
    /// `std::…`), the process's start, libraries without symbols.
    Native,
}

impl FrameKind {
    /// The kind of `frame`.
    pub fn of(frame: &SnapshotFrame) -> FrameKind {
        kind(&frame.name, &frame.filename)
    }

    /// How a folded run names the frames of this kind.
    pub fn name(self) -> &'static str {
        match self {
            FrameKind::User => "the program's",
            FrameKind::PythonLibrary => "Python library",
            FrameKind::RustLibrary => "Rust library",
            FrameKind::Interpreter => "CPython",
            FrameKind::Dispatcher => "dispatcher",
            FrameKind::Libtorch => "libtorch",
            FrameKind::Recorder => "recorder",
            FrameKind::Native => "native",
        }
    }
}

/// The kind of a frame of `function` in `file`.
fn kind(function: &str, file: &str) -> FrameKind {
    if file.ends_with(".py") || file.starts_with('<') {
        // `<frozen importlib._bootstrap>` is Python's own; `<stdin>`,
        // `<string>` and a notebook's `<ipython-input-3-…>` are the user's.
        let library = file.starts_with("<frozen")
            || ["/site-packages/", "/dist-packages/", "/lib/python", "/torch/"].iter().any(|p| file.contains(p));
        return if library { FrameKind::PythonLibrary } else { FrameKind::User };
    }
    if file.ends_with(".rs") {
        let library = ["/rustc/", "/.cargo/registry/", "/.cargo/git/", "/library/std/", "/library/core/"]
            .iter()
            .any(|p| file.contains(p));
        return if library { FrameKind::RustLibrary } else { FrameKind::User };
    }
    native_kind(function)
}

/// The kind of a native (C or C++) frame, from its function's name.
fn native_kind(function: &str) -> FrameKind {
    // A templated function's name may begin with its return type.
    let name = function.strip_prefix("void ").unwrap_or(function);
    if name.starts_with("torch::unwind::") || name.contains("CapturedTraceback") || name.contains("gather_with_cpp") {
        return FrameKind::Recorder;
    }
    if name.starts_with("at::_ops::")
        || name.starts_with("c10::impl::")
        || name.starts_with("c10::Dispatcher")
        || name.starts_with("c10::KernelFunction")
        || name.starts_with("c10::BoxedKernel")
        || name.starts_with("torch::autograd::VariableType::")
        || name.starts_with("torch::ADInplaceOrView::")
        || name.contains("::wrapper_")
    {
        return FrameKind::Dispatcher;
    }
    if ["at::", "c10::", "torch::", "caffe2::", "THP"].iter().any(|p| name.starts_with(p))
        || name.contains("at::native::")
    {
        return FrameKind::Libtorch;
    }
    if !name.contains("::") && (name.starts_with("Py") || name.starts_with("_Py")) {
        return FrameKind::Interpreter;
    }
    FrameKind::Native
}

/// Memory libtorch allocates for its own use, told from its native frames
/// (PyTorch's recordings with `stacks="all"`): no tensor of the program's
/// holds it, whatever line's op made it first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Purpose {
    /// The workspace libtorch gives a cuBLAS handle on a stream, kept as
    /// long as the handle (`at::cuda::setWorkspaceForHandle`).
    CublasWorkspace,
    /// cuBLASLt's workspace (`at::cuda::getCUDABlasLtWorkspace`).
    CublasLtWorkspace,
    /// The workspace a cuDNN convolution runs with, allocated for the call
    /// and freed after it (`at::native::run_conv_plan`, and
    /// `at::native::allocate_workspace` of the older API's path).
    CudnnWorkspace,
}

impl Purpose {
    /// What it is, as a site names it.
    pub fn name(self) -> &'static str {
        match self {
            Purpose::CublasWorkspace => "libtorch's cuBLAS workspace",
            Purpose::CublasLtWorkspace => "libtorch's cuBLASLt workspace",
            Purpose::CudnnWorkspace => "libtorch's cuDNN workspace",
        }
    }

    /// What an allocation with `frames` (innermost first) is for, where its
    /// native frames say it is libtorch's own.
    pub fn of(frames: &[SnapshotFrame]) -> Option<Purpose> {
        Purpose::found(frames).map(|(purpose, _)| purpose)
    }

    /// What an allocation with `frames` is for ([`Purpose::of`]), and the
    /// innermost frame that says so.
    pub fn found(frames: &[SnapshotFrame]) -> Option<(Purpose, &SnapshotFrame)> {
        const SAYS: [(&str, Purpose); 5] = [
            ("at::cuda::getCUDABlasLtWorkspace", Purpose::CublasLtWorkspace),
            ("at::cuda::setWorkspaceForHandle", Purpose::CublasWorkspace),
            ("at::cuda::getCUDABlasWorkspace", Purpose::CublasWorkspace),
            ("at::native::run_conv_plan", Purpose::CudnnWorkspace),
            ("at::native::allocate_workspace", Purpose::CudnnWorkspace),
        ];
        // The first rule that any frame matches wins, cuBLASLt's first: its
        // workspace is reached through calls that may also ask for cuBLAS's.
        SAYS.iter().find_map(|(prefix, purpose)| {
            frames.iter().find(|f| f.name.starts_with(prefix)).map(|frame| (*purpose, frame))
        })
    }
}

/// What an allocation is named after: what libtorch made it for where its
/// native frames say so ([`Purpose`]), else its innermost frame of the
/// program's own (`forward (train.py:57)`), or for a stack without one,
/// what made it ([`made_by`]). `None` for an empty stack.
pub fn site(frames: &[SnapshotFrame]) -> Option<(String, String, u32)> {
    if let Some(purpose) = Purpose::of(frames) {
        return Some((purpose.name().to_string(), String::new(), 0));
    }
    if let Some(f) = frames.iter().find(|f| FrameKind::of(f) == FrameKind::User) {
        return Some((f.name.clone(), f.filename.clone(), f.line));
    }
    if frames.is_empty() {
        return None;
    }
    Some(match made_by(frames) {
        MadeBy::Frame(f) => (f.name.clone(), f.filename.clone(), f.line),
        other => (other.to_string(), String::new(), 0),
    })
}

/// What made an allocation whose stack has no frame of the program's own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MadeBy<'a> {
    /// Autograd's backward pass (on its engine's thread), in the backward
    /// function of the op named, when a frame names it (`MmBackward0`).
    Backward(Option<String>),
    /// Library code in Python or Rust: its innermost frame.
    Frame(&'a SnapshotFrame),
    /// A thread libtorch started, doing something else.
    LibtorchThread,
    /// libtorch, on a thread that also runs no code of the program's.
    Libtorch,
}

impl std::fmt::Display for MadeBy<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MadeBy::Backward(Some(node)) => write!(f, "autograd's backward pass ({node})"),
            MadeBy::Backward(None) => f.write_str("autograd's backward pass"),
            MadeBy::Frame(frame) => f.write_str(&frame.name),
            MadeBy::LibtorchThread => f.write_str("a thread of libtorch's"),
            MadeBy::Libtorch => f.write_str("libtorch, outside the program's code"),
        }
    }
}

/// What made an allocation from `frames` (innermost first), read from its
/// native frames; meant for stacks with no frame of the program's own.
pub fn made_by(frames: &[SnapshotFrame]) -> MadeBy<'_> {
    if frames.iter().any(|f| f.name.starts_with("torch::autograd::Engine::")) {
        return MadeBy::Backward(frames.iter().find_map(|f| backward_node(&f.name)));
    }
    let library = |k: FrameKind| matches!(k, FrameKind::PythonLibrary | FrameKind::RustLibrary);
    if let Some(f) = frames.iter().find(|f| library(FrameKind::of(f))) {
        return MadeBy::Frame(f);
    }
    let outermost = frames.last().map(|f| f.name.as_str()).unwrap_or_default();
    if ["__clone", "clone3", "start_thread"].iter().any(|n| outermost.starts_with(n)) {
        return MadeBy::LibtorchThread;
    }
    MadeBy::Libtorch
}

/// The autograd node a frame runs (`MmBackward0` of
/// `torch::autograd::generated::MmBackward0::apply(…)`).
fn backward_node(function: &str) -> Option<String> {
    let rest = function.strip_prefix("torch::autograd::")?;
    let rest = rest.strip_prefix("generated::").unwrap_or(rest);
    let (node, after) = rest.split_once("::")?;
    let plain = !node.is_empty() && node.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    (plain && after.starts_with("apply(") && node != "Node").then(|| node.to_string())
}

/// One level of a folded stack.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Level {
    /// A frame shown as it is: `function (file:line)`.
    Frame(String),
    /// A run of frames that are not the program's own, folded.
    Folded {
        /// What it shows: `… 23 frames: CPython, libtorch`.
        label: String,
        /// The frames, outermost first.
        frames: Vec<String>,
    },
}

impl Level {
    /// What the level shows.
    pub fn label(&self) -> &str {
        match self {
            Level::Frame(label) | Level::Folded { label, .. } => label,
        }
    }
}

/// The levels a call-stack view shows for `frames` (innermost first), outermost
/// first: each frame of the program's own as it is, and each run of other
/// frames between them folded into one [`Level::Folded`]; a stack with none
/// of the program's frames starts with what it is for ([`Purpose`]) or what
/// made it ([`made_by`]). With
/// `all_frames`, every frame as it is. `label` names a frame.
pub fn fold(frames: &[SnapshotFrame], all_frames: bool, label: impl Fn(&SnapshotFrame) -> String) -> Vec<Level> {
    let mut levels = Vec::new();
    // A stack with no frame of the program's own starts with what made it.
    if !all_frames && !frames.iter().any(|f| FrameKind::of(f) == FrameKind::User) && !frames.is_empty() {
        levels.push(Level::Frame(match (Purpose::of(frames), made_by(frames)) {
            (Some(purpose), _) => purpose.name().to_string(),
            (None, MadeBy::Frame(f)) => label(f),
            (None, other) => other.to_string(),
        }));
    }
    let mut run: Vec<&SnapshotFrame> = Vec::new();
    let flush = |run: &mut Vec<&SnapshotFrame>, levels: &mut Vec<Level>| {
        match run.len() {
            0 => {}
            1 => levels.push(Level::Frame(label(run[0]))),
            n => {
                let mut kinds: Vec<FrameKind> = run.iter().map(|f| FrameKind::of(f)).collect();
                kinds.sort();
                kinds.dedup();
                let names: Vec<&str> = kinds.iter().map(|k| k.name()).collect();
                levels.push(Level::Folded {
                    label: format!("… {n} frames: {}", names.join(", ")),
                    frames: run.iter().map(|f| label(f)).collect(),
                });
            }
        }
        run.clear();
    };
    for frame in frames.iter().rev() {
        if all_frames || FrameKind::of(frame) == FrameKind::User {
            flush(&mut run, &mut levels);
            levels.push(Level::Frame(label(frame)));
        } else {
            run.push(frame);
        }
    }
    flush(&mut run, &mut levels);
    levels
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(name: &str, file: &str) -> SnapshotFrame {
        SnapshotFrame { name: name.into(), filename: file.into(), line: 1 }
    }

    #[test]
    fn libtorchs_workspaces_are_named_for_what_they_are() {
        let native = |name: &str| frame(name, "??");
        let forward = [
            native("c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::allocate(unsigned long)"),
            native("at::cuda::setWorkspaceForHandle(cublasContext*, c10::cuda::CUDAStream)"),
            native("at::cuda::getCurrentCUDABlasHandle()"),
            frame("forward", "/home/u/train.py"),
        ];
        assert_eq!(Purpose::of(&forward), Some(Purpose::CublasWorkspace));
        assert_eq!(site(&forward).map(|s| s.0), Some("libtorch's cuBLAS workspace".to_string()), "not the line");
        let lt = [native("at::cuda::getCUDABlasLtWorkspace()"), native("at::cuda::getCurrentCUDABlasHandle()")];
        assert_eq!(Purpose::of(&lt), Some(Purpose::CublasLtWorkspace));
        let plain = [native("at::native::empty_cuda(c10::ArrayRef<long>)"), frame("forward", "/home/u/train.py")];
        assert_eq!((Purpose::of(&plain), site(&plain).map(|s| s.0)), (None, Some("forward".to_string())));
    }

    #[test]
    fn kinds_of_frames() {
        let cases = [
            ("forward", "/home/me/proj/train.py", FrameKind::User),
            ("<module>", "<stdin>", FrameKind::User),
            ("<module>", "<ipython-input-3-5d4b>", FrameKind::User),
            ("_call_impl", "/usr/lib/python3.12/site-packages/torch/nn/modules/module.py", FrameKind::PythonLibrary),
            ("run", "/usr/lib/python3.12/runpy.py", FrameKind::PythonLibrary),
            ("_find_and_load", "<frozen importlib._bootstrap>", FrameKind::PythonLibrary),
            ("train::step", "/home/me/proj/src/main.rs", FrameKind::User),
            ("std::rt::lang_start", "/rustc/abc/library/std/src/rt.rs", FrameKind::RustLibrary),
            ("tch::Tensor::zeros", "/home/me/.cargo/registry/src/tch-0.24.0/src/x.rs", FrameKind::RustLibrary),
            ("_PyEval_EvalFrameDefault", "??", FrameKind::Interpreter),
            ("PyObject_Call", "??", FrameKind::Interpreter),
            ("at::_ops::mm::call(at::Tensor const&, at::Tensor const&)", "??", FrameKind::Dispatcher),
            ("c10::impl::wrap_kernel_functor_unboxed_<…>::call(…)", "RegisterCUDA_0.cpp", FrameKind::Dispatcher),
            ("at::(anonymous namespace)::wrapper_CUDA_div_Tensor(…)", "RegisterCUDA_0.cpp", FrameKind::Dispatcher),
            (
                "torch::autograd::VariableType::(anonymous namespace)::mm(…)",
                "VariableType_2.cpp",
                FrameKind::Dispatcher,
            ),
            ("at::native::empty_cuda(…)", "??", FrameKind::Libtorch),
            ("void at::native::gpu_reduce_kernel<float, float, 4>(…)", "Reduce.cpp", FrameKind::Libtorch),
            ("THPVariable_dealloc(_object*)", "python_variable.cpp", FrameKind::Libtorch),
            ("torch::autograd::Engine::thread_main(…)", "??", FrameKind::Libtorch),
            ("torch::unwind::unwind()", "??", FrameKind::Recorder),
            ("torch::CapturedTraceback::gather(bool, bool, bool)", "??", FrameKind::Recorder),
            ("std::error_code::default_error_condition() const", "??", FrameKind::Native),
            ("__clone", "??", FrameKind::Native),
            ("_start", "??", FrameKind::Native),
        ];
        for (name, file, want) in cases {
            assert_eq!(kind(name, file), want, "{name} in {file}");
        }
    }

    #[test]
    fn sites_skip_what_is_not_the_programs_own() {
        let forward = [
            frame("torch::unwind::unwind()", "??"),
            frame("at::_ops::mm::call(…)", "??"),
            frame("_call_impl", "/x/site-packages/torch/nn/modules/module.py"),
            frame("forward", "/p/train.py"),
            frame("_PyEval_EvalFrameDefault", "??"),
            frame("train", "/p/train.py"),
        ];
        assert_eq!(site(&forward), Some(("forward".into(), "/p/train.py".into(), 1)));
        let backward = [
            frame("torch::unwind::unwind()", "??"),
            frame("at::_ops::div_Scalar::call(…)", "??"),
            frame("torch::autograd::generated::MeanBackward0::apply(std::vector<at::Tensor>&&)", "??"),
            frame("torch::autograd::Node::operator()(…)", ""),
            frame("torch::autograd::Engine::evaluate_function(…)", "??"),
            frame("torch::autograd::Engine::thread_main(…)", "??"),
            frame("__clone", "??"),
        ];
        assert_eq!(site(&backward), Some(("autograd's backward pass (MeanBackward0)".into(), String::new(), 0)));
        let engine = [frame("torch::autograd::Engine::thread_main(…)", "??"), frame("__clone", "??")];
        assert_eq!(made_by(&engine).to_string(), "autograd's backward pass");
        let thread = [frame("torch::unwind::unwind()", "??"), frame("at::native::foo()", "??"), frame("__clone", "??")];
        assert_eq!(made_by(&thread), MadeBy::LibtorchThread);
        let library = [frame("at::empty()", "??"), frame("step", "/x/site-packages/torch/optim/adam.py")];
        assert_eq!(site(&library), Some(("step".into(), "/x/site-packages/torch/optim/adam.py".into(), 1)));
        assert_eq!(site(&[]), None);
    }

    #[test]
    fn runs_of_other_frames_fold_into_one_level() {
        let frames = [
            frame("torch::unwind::unwind()", "??"),
            frame("at::_ops::mm::call(…)", "??"),
            frame("forward", "/p/train.py"),
            frame("_call_impl", "/x/site-packages/torch/nn/modules/module.py"),
            frame("PyObject_Call", "??"),
            frame("train", "/p/train.py"),
            frame("_PyEval_EvalFrameDefault", "??"),
        ];
        let label = |f: &SnapshotFrame| f.name.clone();
        let levels = fold(&frames, false, label);
        let shown: Vec<&str> = levels.iter().map(Level::label).collect();
        assert_eq!(
            shown,
            [
                "_PyEval_EvalFrameDefault",
                "train",
                "… 2 frames: Python library, CPython",
                "forward",
                "… 2 frames: dispatcher, recorder"
            ]
        );
        let Level::Folded { frames: inside, .. } = &levels[2] else { panic!("{levels:?}") };
        assert_eq!(inside, &["PyObject_Call", "_call_impl"], "outermost first");
        assert_eq!(fold(&frames, true, label).len(), frames.len(), "all frames: none folded");
        let backward = [
            frame("torch::unwind::unwind()", "??"),
            frame("torch::autograd::generated::MmBackward0::apply(std::vector<at::Tensor>&&)", "??"),
            frame("torch::autograd::Engine::thread_main(…)", "??"),
        ];
        let shown: Vec<String> = fold(&backward, false, label).iter().map(|l| l.label().to_string()).collect();
        assert_eq!(shown, ["autograd's backward pass (MmBackward0)", "… 3 frames: libtorch, recorder"]);
    }
}

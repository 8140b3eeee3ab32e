//! Modules loaded after memlab first looked (a notebook's later cells, a
//! plugin): the dynamic loader's count of loads and unloads, which tells the
//! unwinder to read its list again, and the frames of an address in such a
//! module, which the backtrace crate's symbol reader, listing the libraries
//! once, does not know.

/// The loader's count of loads plus unloads so far, where it keeps one
/// (glibc and musl do); `None` elsewhere.
pub(crate) fn changes() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        unsafe extern "C" fn first(info: *mut libc::dl_phdr_info, size: libc::size_t, data: *mut libc::c_void) -> i32 {
            // SAFETY: the loader passes a valid info of `size` bytes, and
            // `data` is the Option handed to dl_iterate_phdr below.
            unsafe { *(data as *mut Option<u64>) = changes_of(&*info, size) };
            1 // The counts are the same in every module's info: one is enough.
        }
        let mut changes = None;
        // SAFETY: `first` only reads the info the loader passes it.
        unsafe { libc::dl_iterate_phdr(Some(first), &mut changes as *mut Option<u64> as *mut libc::c_void) };
        changes
    }
    #[cfg(not(target_os = "linux"))]
    None
}

/// The count of loads plus unloads in a module's info of `size` bytes, if
/// the loader's info is recent enough to hold them.
#[cfg(target_os = "linux")]
pub(crate) fn changes_of(info: &libc::dl_phdr_info, size: usize) -> Option<u64> {
    let end = std::mem::offset_of!(libc::dl_phdr_info, dlpi_subs) + std::mem::size_of::<libc::c_ulonglong>();
    (size >= end).then(|| info.dlpi_adds.wrapping_add(info.dlpi_subs))
}

/// The program headers of the module `info` describes.
///
/// # Safety
/// `info` must come from `dl_iterate_phdr`.
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
pub(crate) unsafe fn headers_of(info: &libc::dl_phdr_info) -> &[libc::Elf64_Phdr] {
    if info.dlpi_phdr.is_null() {
        return &[];
    }
    // SAFETY: the loader gives `dlpi_phnum` program headers at `dlpi_phdr`.
    unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) }
}

/// The addresses the module `info` describes is mapped at.
///
/// # Safety
/// As for [`headers_of`].
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
pub(crate) unsafe fn image_of(info: &libc::dl_phdr_info) -> Option<std::ops::Range<u64>> {
    // SAFETY: as the caller promises.
    let loads = unsafe { headers_of(info) }.iter().filter(|h| h.p_type == libc::PT_LOAD);
    let start = loads.clone().map(|h| h.p_vaddr).min()?;
    let end = loads.map(|h| h.p_vaddr + h.p_memsz).max()?;
    Some(info.dlpi_addr + start..info.dlpi_addr + end)
}

/// The file of the module mapped at `address`, and its load bias (what is
/// added to the file's addresses where it is mapped).
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
pub(crate) fn module_at(address: u64) -> Option<(std::path::PathBuf, u64)> {
    struct Search {
        address: u64,
        found: Option<(std::path::PathBuf, u64)>,
    }
    unsafe extern "C" fn visit(info: *mut libc::dl_phdr_info, _size: libc::size_t, data: *mut libc::c_void) -> i32 {
        // SAFETY: the loader passes a valid info for the duration of the
        // call, and `data` is the Search handed to dl_iterate_phdr below.
        let (info, search) = unsafe { (&*info, &mut *(data as *mut Search)) };
        // SAFETY: `info` comes from dl_iterate_phdr.
        if !unsafe { image_of(info) }.is_some_and(|image| image.contains(&search.address)) {
            return 0;
        }
        // SAFETY: a NUL-terminated path owned by the loader; empty for the program.
        let name = (!info.dlpi_name.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(info.dlpi_name) });
        let path = match name.filter(|n| !n.is_empty()) {
            Some(name) => {
                std::path::PathBuf::from(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(name.to_bytes()))
            }
            None => std::env::current_exe().ok().unwrap_or_default(),
        };
        search.found = Some((path, info.dlpi_addr));
        1
    }
    let mut search = Search { address, found: None };
    // SAFETY: `visit` only reads the headers the loader passes it.
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut search as *mut Search as *mut libc::c_void) };
    search.found.filter(|(path, _)| !path.as_os_str().is_empty())
}

/// A frame as the debug information gives it; any part may be missing.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct RawFrame {
    pub function: Option<String>,
    pub file: Option<String>,
    pub line: Option<u32>,
}

/// The frames at `address` (innermost first, inlined
/// functions included), read from the debug information of the module
/// mapped there, or `None` when no module is mapped there or its file can't
/// be read. For modules loaded after the symbol reader of the backtrace
/// crate listed the libraries, which it does once: they are unknown to it.
/// Each module's file is opened once.
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
pub(crate) fn frames_at(address: u64) -> Option<Vec<RawFrame>> {
    use crate::sync::LockExt;
    use std::sync::Mutex;
    static OPENED: Mutex<Vec<(std::path::PathBuf, Option<addr2line::Loader>)>> = Mutex::new(Vec::new());
    let (path, bias) = module_at(address)?;
    let mut opened = OPENED.locked();
    let index = match opened.iter().position(|(p, _)| *p == path) {
        Some(index) => index,
        None => {
            let loader = addr2line::Loader::new(&path).ok();
            opened.push((path, loader));
            opened.len() - 1
        }
    };
    let loader = opened[index].1.as_ref()?;
    let mut frames = loader.find_frames(address.checked_sub(bias)?).ok()?;
    let mut out = Vec::new();
    while let Ok(Some(frame)) = frames.next() {
        let function = frame.function.as_ref().and_then(|f| f.demangle().ok()).map(|n| n.into_owned());
        let (file, line) = frame.location.map_or((None, None), |l| (l.file.map(str::to_string), l.line));
        out.push(RawFrame { function, file, line });
    }
    Some(out)
}

/// Reads no module on platforms without the loader's module list.
#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
pub(crate) fn frames_at(_address: u64) -> Option<Vec<RawFrame>> {
    None
}

#[cfg(test)]
mod tests {
    #[cfg(target_os = "linux")]
    #[test]
    fn loading_a_library_is_counted() {
        let name = std::ffi::CString::new("libresolv.so.2").unwrap();
        // SAFETY: asks whether a system library is loaded, without loading it.
        let loaded = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        assert!(loaded.is_null(), "libresolv is not loaded yet, so loading it is a change");
        let before = super::changes().expect("the loader keeps a count");
        // SAFETY: loads a system library, which stays loaded.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW) };
        assert!(!handle.is_null(), "libresolv loads");
        assert!(super::changes().unwrap() > before, "the load is counted");
    }

    /// The frames of an address in this test program, read from its file,
    /// are the ones the backtrace crate reads.
    #[cfg(all(target_os = "linux", target_pointer_width = "64"))]
    #[test]
    fn frames_read_from_the_file_are_the_backtrace_crates() {
        let here = super::frames_at as *const () as u64;
        let ours = super::frames_at(here + 1).expect("this program's frames are read");
        let mut theirs = Vec::new();
        backtrace::resolve((here + 1) as *mut std::ffi::c_void, |s| {
            theirs.push(super::RawFrame {
                function: s.name().map(|n| format!("{n:#}")),
                file: s.filename().map(|f| f.display().to_string()),
                line: s.lineno(),
            });
        });
        assert!(!ours.is_empty() && ours[0].file.as_deref().is_some_and(|f| f.ends_with("loader.rs")), "{ours:?}");
        assert_eq!(ours, theirs);
        assert!(super::frames_at(8).is_none(), "no module is mapped at 8");
    }
}

//! Headless Chromium (Debian's `chromium`) driven through the DevTools
//! protocol over a pipe (`--remote-debugging-pipe`: the browser reads
//! commands on descriptor 3 and writes answers and events on descriptor 4,
//! each a JSON text ended by a NUL byte), so tests look at a page the way a
//! person does: they load it, read what the console says, move the mouse
//! over a drawing and see what is hovered.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// How long any one answer may take before the test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(60);

/// The browser's command name on this machine, or `None` (with a note) where
/// none is installed and CI is not running: CI installs Debian's package
/// (`.ci/run`), and a test there must not pass without it.
pub fn command() -> Option<&'static str> {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        if Command::new(name).arg("--version").output().is_ok_and(|o| o.status.success()) {
            return Some(name);
        }
    }
    assert!(std::env::var_os("CI").is_none(), "CI must have chromium: .ci/run installs Debian's package");
    eprintln!("skipped: no chromium on PATH (apt-get install chromium) to open the HTML report");
    None
}

/// A running headless browser.
pub struct Browser {
    child: Child,
    commands: File,
    messages: Receiver<Value>,
    next_id: u64,
    /// Events that arrived while waiting for answers, oldest first.
    events: Vec<Value>,
}

/// A page of the browser, attached in its own session.
pub struct Page<'a> {
    browser: &'a mut Browser,
    session: String,
}

/// Two pipes' ends moved above the descriptors a child inherits by number,
/// closed on exec; the child's `pre_exec` puts them at 3 and 4.
fn pipe() -> (RawFd, RawFd) {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0, "pipe2");
    let high = |fd: RawFd| {
        // SAFETY: duplicating a descriptor this process owns, then closing the original.
        let moved = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10) };
        assert!(moved >= 10, "fcntl");
        unsafe { libc::close(fd) };
        moved
    };
    (high(fds[0]), high(fds[1]))
}

impl Browser {
    /// Starts headless Chromium with a window of `width`×`height` CSS pixels;
    /// `None` where no browser is installed (see [`command`]).
    pub fn launch(width: u32, height: u32) -> Option<Browser> {
        let name = command()?;
        let (their_read, our_write) = pipe();
        let (our_read, their_write) = pipe();
        let mut cmd = Command::new(name);
        cmd.args(["--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--hide-scrollbars"])
            .arg(format!("--window-size={width},{height}"))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: between fork and exec only async-signal-safe calls: dup2.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(their_read, 3) < 0 || libc::dup2(their_write, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("start chromium");
        // SAFETY: the child has its copies; these ends are the parent's to close or own.
        unsafe {
            libc::close(their_read);
            libc::close(their_write);
        }
        let commands = unsafe { File::from_raw_fd(our_write) };
        let answers = unsafe { File::from_raw_fd(our_read) };
        let (send, messages) = channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(answers);
            let mut buf = Vec::new();
            while reader.read_until(0, &mut buf).is_ok_and(|n| n > 0) {
                buf.pop_if(|b| *b == 0);
                // Two ifs, not a let chain: memlab-cli's tests (edition 2021)
                // share this file.
                #[allow(clippy::collapsible_if)]
                if let Ok(message) = serde_json::from_slice::<Value>(&buf) {
                    if send.send(message).is_err() {
                        break;
                    }
                }
                buf.clear();
            }
        });
        Some(Browser { child, commands, messages, next_id: 1, events: Vec::new() })
    }

    /// Sends `method` (to a page's `session`, or to the browser) and returns
    /// its result; events that arrive meanwhile are kept.
    fn call(&mut self, session: Option<&str>, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let mut message = json!({ "id": id, "method": method, "params": params });
        if let Some(session) = session {
            message["sessionId"] = json!(session);
        }
        let mut bytes = serde_json::to_vec(&message).unwrap();
        bytes.push(0);
        self.commands.write_all(&bytes).expect("chromium reads its commands");
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let message = self.messages.recv_timeout(left).unwrap_or_else(|_| panic!("chromium answers {method}"));
            if message["id"] == id {
                assert!(message.get("error").is_none(), "{method} failed: {}", message["error"]);
                return message["result"].clone();
            }
            self.events.push(message);
        }
    }

    /// Opens `url` in a new page and waits until it has loaded.
    pub fn open(&mut self, url: &str) -> Page<'_> {
        let target = self.call(None, "Target.createTarget", json!({ "url": "about:blank" }));
        let attached =
            self.call(None, "Target.attachToTarget", json!({ "targetId": target["targetId"], "flatten": true }));
        let session = attached["sessionId"].as_str().expect("a session").to_string();
        for domain in ["Page.enable", "Runtime.enable", "Log.enable"] {
            self.call(Some(&session), domain, json!({}));
        }
        self.events.clear();
        self.call(Some(&session), "Page.navigate", json!({ "url": url }));
        let mut page = Page { browser: self, session };
        page.wait_for("Page.loadEventFired");
        page
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Page<'_> {
    fn call(&mut self, method: &str, params: Value) -> Value {
        let session = self.session.clone();
        self.browser.call(Some(&session), method, params)
    }

    fn wait_for(&mut self, event: &str) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if self.browser.events.iter().any(|e| e["method"] == event && e["sessionId"] == self.session.as_str()) {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let message = self.browser.messages.recv_timeout(left).unwrap_or_else(|_| panic!("the page fires {event}"));
            self.browser.events.push(message);
        }
    }

    /// The value of a JavaScript expression, evaluated by the DevTools
    /// protocol (outside the page's content security policy, which forbids
    /// the page any script of its own).
    pub fn eval(&mut self, expression: &str) -> Value {
        let result = self.call("Runtime.evaluate", json!({ "expression": expression, "returnByValue": true }));
        assert!(result.get("exceptionDetails").is_none(), "{expression}: {}", result["exceptionDetails"]);
        result["result"]["value"].clone()
    }

    /// Moves the mouse to the centre of the element `selector` finds (scrolled
    /// into view first) and returns the text of the `<title>` of the element
    /// the page then says is hovered (`:hover`, innermost that matches
    /// `hovered`): what the browser's tooltip shows.
    pub fn hover(&mut self, selector: &str, hovered: &str) -> Option<String> {
        let centre = self.eval(&format!(
            "(() => {{ const e = document.querySelector({selector:?}); e.scrollIntoView({{block: 'center'}}); \
             const r = e.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; }})()"
        ));
        let (x, y) = (centre[0].as_f64().unwrap(), centre[1].as_f64().unwrap());
        self.call("Input.dispatchMouseEvent", json!({ "type": "mouseMoved", "x": x, "y": y }));
        let title = self.eval(&format!(
            "(() => {{ const all = document.querySelectorAll({:?}); const e = all[all.length - 1]; \
             return e ? e.querySelector('title').textContent : null; }})()",
            format!("{hovered}:hover")
        ));
        title.as_str().map(str::to_string)
    }

    /// Clicks the centre of the element `selector` finds (scrolled into view
    /// first) with the mouse, as a person would.
    pub fn click(&mut self, selector: &str) {
        let centre = self.eval(&format!(
            "(() => {{ const e = document.querySelector({selector:?}); e.scrollIntoView({{block: 'center'}}); \
             const r = e.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; }})()"
        ));
        let (x, y) = (centre[0].as_f64().unwrap(), centre[1].as_f64().unwrap());
        for kind in ["mousePressed", "mouseReleased"] {
            let event = json!({ "type": kind, "x": x, "y": y, "button": "left", "clickCount": 1 });
            self.call("Input.dispatchMouseEvent", event);
        }
    }

    /// What the console said that is an error: messages at level `error`,
    /// content-security-policy violations, uncaught exceptions.
    pub fn console_errors(&mut self) -> Vec<String> {
        // A round trip, so that messages logged during the load have arrived.
        self.eval("1");
        let session = self.session.as_str();
        self.browser
            .events
            .iter()
            .filter(|e| e["sessionId"] == session)
            .filter_map(|e| match e["method"].as_str()? {
                "Log.entryAdded" if e["params"]["entry"]["level"] == "error" => {
                    Some(e["params"]["entry"]["text"].as_str().unwrap_or_default().to_string())
                }
                "Runtime.exceptionThrown" => Some(e["params"]["exceptionDetails"].to_string()),
                "Runtime.consoleAPICalled" if e["params"]["type"] == "error" => Some(e["params"]["args"].to_string()),
                _ => None,
            })
            .collect()
    }
}

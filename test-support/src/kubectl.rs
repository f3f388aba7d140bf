//! Running real commands with some standard input, and `kubectl` against a test API server.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
};

use anyhow::Context as _;

/// Runs `cmd` with `stdin` (none: an empty standard input) and collects its output.
pub fn output(cmd: &mut Command, stdin: Option<&str>) -> anyhow::Result<Output> {
    let mut child = cmd
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {cmd:?}"))?;
    if let Some(text) = stdin {
        // Dropped at the end of this statement: the command sees EOF.
        child
            .stdin
            .take()
            .context("stdin")?
            .write_all(text.as_bytes())
            .with_context(|| format!("writing to {cmd:?}"))?;
    }
    Ok(child.wait_with_output()?)
}

/// Runs `cmd` with `stdin`; its standard output, or an error with its standard error unless
/// it succeeded.
pub fn stdout_of(cmd: &mut Command, stdin: Option<&str>) -> anyhow::Result<String> {
    let out = output(cmd, stdin)?;
    anyhow::ensure!(
        out.status.success(),
        "{cmd:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `kubectl` with one kubeconfig.
#[derive(Debug)]
pub struct Kubectl {
    pub bin: PathBuf,
    pub kubeconfig: PathBuf,
}

impl Kubectl {
    /// The kubectl of `scripts/setup.sh` (or `MCS_KUBE_BIN_DIR`) with `kubeconfig`.
    pub fn new(kubeconfig: &Path) -> anyhow::Result<Self> {
        let bin = crate::apiserver::find_kube_binary("kubectl")
            .context("kubectl not found (set MCS_KUBE_BIN_DIR or run `bash scripts/setup.sh`)")?;
        Ok(Kubectl {
            bin,
            kubeconfig: kubeconfig.to_path_buf(),
        })
    }

    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.arg("--kubeconfig").arg(&self.kubeconfig);
        cmd
    }

    /// Runs `kubectl ARGS` with `stdin`, whatever its exit.
    pub fn run(&self, args: &[&str], stdin: Option<&str>) -> anyhow::Result<Output> {
        output(self.command().args(args), stdin)
    }

    /// Runs `kubectl ARGS` with `stdin`; its standard output, or an error unless it succeeded.
    pub fn ok(&self, args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
        stdout_of(self.command().args(args), stdin)
    }

    /// `kubectl apply -f -` of `yaml`.
    pub fn apply(&self, yaml: &str) -> anyhow::Result<()> {
        self.ok(&["apply", "-f", "-"], Some(yaml)).map(drop)
    }
}

//! The layout of the generated PTX: directives and comments flush left, an entry's body
//! indented but for its labels, trailing comments in one column. The emitters write bare
//! lines and leave the layout to this writer.

/// The column trailing comments start at (counted from 0).
const COMMENT_COLUMN: usize = 41;
/// The width an entry's parameter list wraps at.
const PARAMETER_WIDTH: usize = 110;
const INDENT: &str = "    ";

/// Writes lines of PTX text through `format!`: `ptx!(out, "add.u64 {sum}, {a}, {b};")`.
macro_rules! ptx {
    ($out:expr, $($format:tt)*) => {
        $out.lines(&format!($($format)*))
    };
}
pub(super) use ptx;

/// A PTX module's text, written line by line.
#[derive(Default)]
pub(super) struct Ptx {
    text: String,
    in_body: bool,
}

impl Ptx {
    /// Writes each non-blank line of `text`, laid out; leading white space is dropped.
    pub(super) fn lines(&mut self, text: &str) {
        for line in text.lines().map(str::trim).filter(|line| !line.is_empty()) {
            self.line(line);
        }
    }

    /// An empty line.
    pub(super) fn blank(&mut self) {
        self.text.push('\n');
    }

    /// The head of a kernel, `.visible .entry name(params)` (each param `type name`), its
    /// parameter list wrapped under the opening parenthesis, and the opening brace of its body.
    pub(super) fn entry(&mut self, name: &str, params: &[&str]) {
        let head = format!(".visible .entry {name}(");
        let mut line = head.clone();
        let mut line_has_param = false;
        for (i, param) in params.iter().enumerate() {
            let param = format!(".param {param}{}", if i + 1 == params.len() { ")" } else { "," });
            if line_has_param && line.len() + 1 + param.len() > PARAMETER_WIDTH {
                self.text.push_str(&line);
                self.text.push('\n');
                line = " ".repeat(head.len());
            } else if line_has_param {
                line.push(' ');
            }
            line.push_str(&param);
            line_has_param = true;
        }
        self.text.push_str(&line);
        self.text.push('\n');
        self.line("{");
    }

    /// The module's text.
    pub(super) fn finish(self) -> String {
        assert!(!self.in_body, "an entry's body is not closed");
        self.text
    }

    fn line(&mut self, line: &str) {
        let is_label = line.ends_with(':') && !line.starts_with("//");
        let indent = match line {
            "{" | "}" => {
                self.in_body = line == "{";
                ""
            }
            _ if self.in_body && !is_label => INDENT,
            _ => "",
        };
        let start = self.text.len();
        self.text.push_str(indent);
        match line.split_once("//") {
            Some((code, comment)) if !code.trim().is_empty() => {
                self.text.push_str(code.trim_end());
                let width = self.text.len() - start;
                let padding = COMMENT_COLUMN.saturating_sub(width).max(1);
                self.text.push_str(&" ".repeat(padding));
                self.text.push_str("//");
                self.text.push_str(comment);
            }
            _ => self.text.push_str(line),
        }
        self.text.push('\n');
    }
}

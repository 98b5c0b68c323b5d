//! A lint of command templates (D63): a `{body}` that sits inside shell quotes. `{body}` becomes
//! the params file's path, already shell-quoted (D2); inside `'…'` or `"…"` the command gets that
//! path as text where its author meant the JSON (`curl -d '{body}'` posts the path).
//!
//! A small lexer of what bash does with quotes, enough to say where each `{body}` is: `'…'`,
//! `"…"`, `$'…'` (with its `\'`), `$"…"`, backslash escapes, `$(…)`, `$((…))` and backticks
//! (whose inside is unquoted again, even within `"…"`), `#` comments and here-document bodies
//! (skipped: they are not run as written, and an apostrophe in them opens no quote). It works on
//! the template as written, where `{body}` is still one token. What it does not model (a `)` of a
//! `case` pattern inside `$(…)`, nested backticks) can only cost a warning, never a start.

/// What a quoted `{body}` is quoted by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quote {
    Single,
    Double,
    /// `$'…'`.
    AnsiC,
}

impl Quote {
    fn describe(self) -> &'static str {
        match self {
            Quote::Single => "single quotes",
            Quote::Double => "double quotes",
            Quote::AnsiC => "$'…' quotes",
        }
    }
}

/// One `{body}` inside quotes: how, and on which line of the template (from 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotedBody {
    pub quote: Quote,
    pub line: usize,
}

const BODY: &str = "{body}";

/// The warning for one quoted `{body}`; `lines` is the template's line count (a one-line
/// template names no line).
pub fn warning(q: &QuotedBody, lines: usize) -> String {
    let at = if lines > 1 {
        format!(" (line {} of the template)", q.line)
    } else {
        String::new()
    };
    format!(
        "`{{body}}` inside {}{at}: it becomes the params file's path, already quoted, so the command gets the path as text, not the JSON; for curl write `-d @{{body}}`, elsewhere `\"$(cat {{body}})\"` for the JSON (or a bare `{{body}}` for the path)",
        q.quote.describe()
    )
}

/// The warnings for a shell template (none for a module: `infer.py` runs no shell).
pub fn warnings(template: &str) -> Vec<String> {
    if crate::workload::module_of(template).is_some() {
        return Vec::new();
    }
    let lines = template.lines().count();
    quoted_bodies(template)
        .iter()
        .map(|q| warning(q, lines))
        .collect()
}

/// Every `{body}` of `template` that sits inside quotes, in order.
pub fn quoted_bodies(template: &str) -> Vec<QuotedBody> {
    let mut lx = Lexer {
        rest: template.chars(),
        line: 1,
        prev: None,
        stack: Vec::new(),
        heredocs: Vec::new(),
        found: Vec::new(),
    };
    lx.run();
    lx.found
}

/// Where the lexer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ctx {
    Single,
    AnsiC,
    Double,
    /// `$(…)`, with the `(` opened inside it not yet closed.
    Subst(u32),
    /// `$((…))`: no comments or here-documents in there (`<<` is a shift).
    Arith(u32),
    Backtick,
}

/// A here-document whose body starts at the next line: its delimiter, and whether leading
/// tabs are stripped (`<<-`).
struct HereDoc {
    delimiter: String,
    strip_tabs: bool,
}

struct Lexer<'a> {
    rest: std::str::Chars<'a>,
    line: usize,
    prev: Option<char>,
    /// Empty: the template's own level (unquoted code).
    stack: Vec<Ctx>,
    heredocs: Vec<HereDoc>,
    found: Vec<QuotedBody>,
}

impl Lexer<'_> {
    fn next(&mut self) -> Option<char> {
        let c = self.rest.next()?;
        if c == '\n' {
            self.line = self.line.saturating_add(1);
        }
        Some(c)
    }

    fn peek(&self) -> Option<char> {
        self.rest.clone().next()
    }

    fn at_body(&self) -> bool {
        self.rest.as_str().starts_with(BODY)
    }

    /// The quote a `{body}` here is inside, if any (the innermost context decides: `$(…)` and
    /// backticks unquote).
    fn quote(&self) -> Option<Quote> {
        match self.stack.last()? {
            Ctx::Single => Some(Quote::Single),
            Ctx::AnsiC => Some(Quote::AnsiC),
            Ctx::Double => Some(Quote::Double),
            Ctx::Subst(_) | Ctx::Arith(_) | Ctx::Backtick => None,
        }
    }

    fn run(&mut self) {
        loop {
            if self.at_body() {
                if let Some(quote) = self.quote() {
                    self.found.push(QuotedBody {
                        quote,
                        line: self.line,
                    });
                }
                for _ in BODY.chars() {
                    self.next();
                }
                self.prev = Some('}');
                continue;
            }
            let Some(c) = self.next() else {
                return;
            };
            match self.stack.last().copied() {
                Some(Ctx::Single) => {
                    if c == '\'' {
                        self.stack.pop();
                    }
                }
                Some(Ctx::AnsiC) => match c {
                    '\\' => self.escaped(),
                    '\'' => {
                        self.stack.pop();
                    }
                    _ => {}
                },
                Some(Ctx::Double) => self.double(c),
                top => self.code(c, top),
            }
            self.prev = Some(c);
        }
    }

    /// Past the character a backslash escapes (unless a `{body}` starts there: it is replaced
    /// before the shell reads the line, so the backslash escapes the path's first character).
    fn escaped(&mut self) {
        if !self.at_body() {
            self.next();
        }
    }

    fn double(&mut self, c: char) {
        match c {
            '"' => {
                self.stack.pop();
            }
            '\\' if matches!(self.peek(), Some('$' | '`' | '"' | '\\' | '\n')) => self.escaped(),
            '$' if self.peek() == Some('(') => {
                self.next();
                self.open_subst();
            }
            '`' => self.stack.push(Ctx::Backtick),
            _ => {}
        }
    }

    fn open_subst(&mut self) {
        if self.peek() == Some('(') {
            self.next();
            self.stack.push(Ctx::Arith(0));
        } else {
            self.stack.push(Ctx::Subst(0));
        }
    }

    /// Unquoted code: the template's own level, `$(…)`, `$((…))` or backticks.
    fn code(&mut self, c: char, top: Option<Ctx>) {
        let arith = matches!(top, Some(Ctx::Arith(_)));
        match c {
            '\\' => self.escaped(),
            '\'' => self.stack.push(Ctx::Single),
            '"' => self.stack.push(Ctx::Double),
            '$' => match self.peek() {
                Some('\'') => {
                    self.next();
                    self.stack.push(Ctx::AnsiC);
                }
                Some('"') => {
                    self.next();
                    self.stack.push(Ctx::Double);
                }
                Some('(') => {
                    self.next();
                    self.open_subst();
                }
                _ => {}
            },
            '`' if top == Some(Ctx::Backtick) => {
                self.stack.pop();
            }
            '`' => self.stack.push(Ctx::Backtick),
            '(' => self.nest(top, true),
            ')' => self.nest(top, false),
            '#' if !arith && self.word_start() => self.comment(),
            '<' if !arith && self.peek() == Some('<') => {
                self.next();
                if self.peek() == Some('<') {
                    // A here-string: its word is read like any other.
                    self.next();
                } else {
                    self.heredoc();
                }
            }
            '\n' if !self.heredocs.is_empty() => self.heredoc_bodies(),
            _ => {}
        }
    }

    /// A `(` or `)` inside `$(…)` / `$((…))`: one level deeper, shallower, or the end.
    fn nest(&mut self, top: Option<Ctx>, open: bool) {
        let Some(last) = self.stack.last_mut() else {
            return;
        };
        match (top, open) {
            (Some(Ctx::Subst(d)), true) => *last = Ctx::Subst(d.saturating_add(1)),
            (Some(Ctx::Arith(d)), true) => *last = Ctx::Arith(d.saturating_add(1)),
            (Some(Ctx::Subst(0)), false) => {
                self.stack.pop();
            }
            (Some(Ctx::Arith(0)), false) => {
                // `))` ends it.
                if self.peek() == Some(')') {
                    self.next();
                }
                self.stack.pop();
            }
            (Some(Ctx::Subst(d)), false) => *last = Ctx::Subst(d.saturating_sub(1)),
            (Some(Ctx::Arith(d)), false) => *last = Ctx::Arith(d.saturating_sub(1)),
            _ => {}
        }
    }

    /// A `#` starts a comment only at the start of a word.
    fn word_start(&self) -> bool {
        match self.prev {
            None => true,
            Some(p) => p.is_whitespace() || matches!(p, ';' | '&' | '|' | '(' | ')' | '<' | '>'),
        }
    }

    /// Up to (not past) the end of the line.
    fn comment(&mut self) {
        while self.peek().is_some_and(|c| c != '\n') {
            self.next();
        }
    }

    /// After `<<`: the delimiter word, quotes removed; its body starts at the next line.
    fn heredoc(&mut self) {
        let strip_tabs = self.peek() == Some('-');
        if strip_tabs {
            self.next();
        }
        while matches!(self.peek(), Some(' ' | '\t')) {
            self.next();
        }
        let mut delimiter = String::new();
        while let Some(c) = self.peek() {
            if c.is_whitespace() || matches!(c, ';' | '&' | '|' | '<' | '>' | '(' | ')') {
                break;
            }
            self.next();
            match c {
                '\'' | '"' => {
                    while let Some(q) = self.next() {
                        if q == c {
                            break;
                        }
                        delimiter.push(q);
                    }
                }
                '\\' => delimiter.extend(self.next()),
                other => delimiter.push(other),
            }
        }
        if !delimiter.is_empty() {
            self.heredocs.push(HereDoc {
                delimiter,
                strip_tabs,
            });
        }
    }

    /// The bodies of the here-documents opened on the line that just ended, skipped up to and
    /// including each one's delimiter line.
    fn heredoc_bodies(&mut self) {
        for doc in std::mem::take(&mut self.heredocs) {
            loop {
                if self.peek().is_none() {
                    return;
                }
                let mut line = String::new();
                while let Some(c) = self.next() {
                    if c == '\n' {
                        break;
                    }
                    line.push(c);
                }
                let line = if doc.strip_tabs {
                    line.trim_start_matches('\t')
                } else {
                    line.as_str()
                };
                if line == doc.delimiter {
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(template: &str) -> Vec<(Quote, usize)> {
        quoted_bodies(template)
            .into_iter()
            .map(|b| (b.quote, b.line))
            .collect()
    }

    #[test]
    fn d63_the_curl_template_of_a_snap_served_model_is_found() {
        let t = "curl -sf -X POST http://localhost:8080/act \\\n  -H \"Content-Type: application/json\" \\\n  -d '{body}'\n";
        assert_eq!(q(t), vec![(Quote::Single, 3)]);
        assert!(q("curl -sf -X POST http://localhost:8080/act -d @{body}").is_empty());
    }

    #[test]
    fn d63_bare_and_substituted_bodies_are_fine() {
        for t in [
            "python train.py {body}",
            "source \"$HOME/.venv/x/bin/activate\" && \\\npython preview.py {body}\n",
            "python x.py \"$(cat {body})\"",
            "python x.py \"`cat {body}`\"",
            "python x.py `cat {body}`",
            "python x.py $(cat {body})",
            "echo $((1 + 2)) {body}",
            "x={body}; python y.py \"$x\"",
            "python x.py {{body}}",
            "",
            "{body",
        ] {
            assert!(q(t).is_empty(), "{t:?}: {:?}", q(t));
        }
    }

    #[test]
    fn d63_each_kind_of_quote() {
        assert_eq!(q("python x.py '{body}'"), vec![(Quote::Single, 1)]);
        assert_eq!(q("python x.py \"{body}\""), vec![(Quote::Double, 1)]);
        assert_eq!(q("python x.py $'{body}'"), vec![(Quote::AnsiC, 1)]);
        assert_eq!(q("python x.py $\"{body}\""), vec![(Quote::Double, 1)]);
        assert_eq!(q("python x.py --params='{body}'"), vec![(Quote::Single, 1)]);
        assert_eq!(
            q("python x.py \"--params={body}\""),
            vec![(Quote::Double, 1)]
        );
    }

    #[test]
    fn d63_escaped_quotes_open_and_close_nothing() {
        // `\'` outside quotes is a literal apostrophe.
        assert!(q("echo it\\'s {body}").is_empty());
        assert!(q("echo 'it'\\''s' {body}").is_empty());
        // `\"` inside double quotes does not close them.
        assert_eq!(
            q("echo \"say \\\"hi\\\" {body}\""),
            vec![(Quote::Double, 1)]
        );
        // An escaped backslash does not escape the quote after it.
        assert!(q("echo \"a\\\\\" {body}").is_empty());
        // Inside single quotes a backslash is literal: the quote after it closes them.
        assert!(q("echo 'a\\' {body}").is_empty());
        // `$'…'` has `\'`.
        assert_eq!(q("echo $'it\\'s {body}'"), vec![(Quote::AnsiC, 1)]);
        assert!(q("echo $'a\\\\' {body}").is_empty());
        // A backslash right before `{body}` escapes the path's first character, not the body.
        assert!(q("echo \\{body}").is_empty());
        assert_eq!(q("echo '\\{body}'"), vec![(Quote::Single, 1)]);
    }

    #[test]
    fn d63_nested_substitutions_unquote_and_requote() {
        assert_eq!(
            q("python x.py \"$(python -c 'print(1)' '{body}')\""),
            vec![(Quote::Single, 1)]
        );
        assert_eq!(q("echo \"$(echo \"{body}\")\""), vec![(Quote::Double, 1)]);
        assert!(q("echo \"$(echo \"$(cat {body})\")\"").is_empty());
        assert!(q("echo \"$( (cat {body}) )\" \"x\"").is_empty());
        assert_eq!(
            q("echo \"$( (cat {body}) )\" \"{body}\""),
            vec![(Quote::Double, 1)]
        );
        assert_eq!(q("echo `echo '{body}'`"), vec![(Quote::Single, 1)]);
        // `<<` in arithmetic is a shift, not a here-document.
        assert_eq!(q("echo $((1<<2)) '{body}'\nx"), vec![(Quote::Single, 1)]);
    }

    #[test]
    fn d63_every_occurrence_is_judged_on_its_own() {
        assert_eq!(q("a {body} '{body}'"), vec![(Quote::Single, 1)]);
        assert_eq!(
            q("a '{body}' \"{body}\"\nb {body}\nc '{body}'"),
            vec![(Quote::Single, 1), (Quote::Double, 1), (Quote::Single, 3)]
        );
        assert_eq!(
            q("'{body}{body}'"),
            vec![(Quote::Single, 1), (Quote::Single, 1)]
        );
    }

    #[test]
    fn d63_unicode_around_the_body() {
        assert_eq!(
            q("echo 'héllo — ✓' {body} \"日本 {body} 🚀\""),
            vec![(Quote::Double, 1)]
        );
        assert_eq!(q("echo '🚀{body}'"), vec![(Quote::Single, 1)]);
    }

    #[test]
    fn d63_comments_and_here_documents_are_not_code() {
        // An apostrophe in a comment opens nothing; a `{body}` there does not run.
        assert_eq!(
            q("# don't quote it\npython x.py '{body}' # it's '{body}'"),
            vec![(Quote::Single, 2)]
        );
        // `#` inside a word is no comment.
        assert_eq!(q("echo a#'{body}'"), vec![(Quote::Single, 1)]);
        let t = "cat <<'EOF' > notes.txt\nit's '{body}'\nEOF\ncurl -d '{body}' x\n";
        assert_eq!(q(t), vec![(Quote::Single, 4)]);
        let t = "cat <<-END\n\tdon't\n\tEND\npython x.py {body}\n";
        assert!(q(t).is_empty(), "{:?}", q(t));
        // A here-string is a word like any other.
        assert_eq!(q("python x.py <<< '{body}'"), vec![(Quote::Single, 1)]);
        // A here-document that never ends swallows the rest.
        assert!(q("cat <<EOF\n'{body}'\n").is_empty());
    }

    #[test]
    fn d63_unterminated_quotes_still_count() {
        assert_eq!(q("echo '{body}"), vec![(Quote::Single, 1)]);
        assert_eq!(q("echo \"$(cat '{body}"), vec![(Quote::Single, 1)]);
    }

    #[test]
    fn d63_a_module_gets_no_warning_and_the_wording_names_the_fix() {
        assert!(warnings("infer.py").is_empty());
        let w = warnings("curl -X POST http://h/act \\\n  -d '{body}'\n");
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("single quotes"), "{}", w[0]);
        assert!(w[0].contains("line 2 of the template"), "{}", w[0]);
        assert!(w[0].contains("`-d @{body}`"), "{}", w[0]);
        assert!(w[0].contains("`\"$(cat {body})\"`"), "{}", w[0]);
        assert!(w[0].contains("path as text, not the JSON"), "{}", w[0]);
        let w = warnings("python x.py \"{body}\"");
        assert!(!w[0].contains("line"), "{}", w[0]);
    }
}

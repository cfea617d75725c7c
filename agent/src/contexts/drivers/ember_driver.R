# ember's R context driver. Embedded in ember-agent and written to /run/ember/drivers when an R
# context first starts; run as `Rscript --vanilla ember_driver.R`.
#
# Descriptors (see "Code contexts" in agent/PROTOCOL.md): fd 0 is the agent's socket, on which
# requests arrive (one frame each: u32 LE length + fields `NAME LEN\n` + LEN bytes + `\n`; op =
# run | setup | ack; code; cwd; reseed; env.KEY); fd 3 a pipe on which events go back as framed
# JSON, the Python driver's events (ready, result, display, exception, end, error); fd 1/2 are
# pipes the agent reads (print() and cat() write there; warnings go to stderr at once).
#
# A cell is parsed and its top-level expressions evaluated in the global environment one by one,
# printing visible values as R's REPL does; the last visible value is the result instead (text
# as R prints it, a data.frame also as an HTML table). Plots need no device call: the default
# device is a PNG file per page, and every page drawn during the cell is sent as image/png.
# SIGINT interrupts the cell (an `interrupt` condition). Base R only.

local({
  requests <- file("stdin", open = "rb")
  events <- file("/dev/fd/3", open = "wb")
  plot_dir <- file.path(tempdir(), "ember-plots")
  dir.create(plot_dir, showWarnings = FALSE)
  count <- 0L

  # ---- the channel ----

  u32 <- function(n) as.raw(c(n %% 256, (n %/% 256) %% 256, (n %/% 65536) %% 256, (n %/% 16777216) %% 256))

  jstr <- function(s) {
    s <- enc2utf8(paste(as.character(s), collapse = "\n"))
    s <- gsub("\\", "\\\\", s, fixed = TRUE)
    s <- gsub("\"", "\\\"", s, fixed = TRUE)
    s <- gsub("\n", "\\n", s, fixed = TRUE)
    s <- gsub("\r", "\\r", s, fixed = TRUE)
    s <- gsub("\t", "\\t", s, fixed = TRUE)
    s <- gsub("[\001-\037]", "", s, perl = TRUE)
    paste0("\"", s, "\"")
  }

  jbundle <- function(data) {
    keys <- vapply(names(data), jstr, "", USE.NAMES = FALSE)
    values <- vapply(data, jstr, "", USE.NAMES = FALSE)
    paste0("{", paste0(keys, ":", values, collapse = ","), "}")
  }

  send <- function(...) {
    flush(stdout())
    flush(stderr())
    out <- list()
    for (json in c(...)) {
      body <- charToRaw(enc2utf8(json))
      out[[length(out) + 1L]] <- c(u32(length(body)), body)
    }
    writeBin(unlist(out), events)
    flush(events)
  }

  read_exact <- function(n) {
    got <- raw(0)
    while (length(got) < n) {
      chunk <- readBin(requests, "raw", n - length(got))
      if (length(chunk) == 0L) quit(save = "no", status = 0)
      got <- c(got, chunk)
    }
    got
  }

  next_request <- function() {
    head <- as.integer(read_exact(4L))
    n <- head[1] + head[2] * 256 + head[3] * 65536 + head[4] * 16777216
    body <- read_exact(n)
    msg <- list(env = list())
    i <- 1L
    while (i <= length(body)) {
      nl <- i - 1L + match(as.raw(10L), body[i:length(body)])
      parts <- strsplit(rawToChar(body[i:(nl - 1L)]), " ", fixed = TRUE)[[1]]
      len <- as.integer(parts[2])
      value <- if (len > 0L) rawToChar(body[(nl + 1L):(nl + len)]) else ""
      Encoding(value) <- "UTF-8"
      if (startsWith(parts[1], "env.")) msg$env[[substring(parts[1], 5L)]] <- value
      else msg[[parts[1]]] <- value
      i <- nl + len + 2L
    }
    msg
  }

  # ---- rich values ----

  b64 <- function(r) {
    chars <- c(LETTERS, letters, 0:9, "+", "/")
    pad <- (3L - length(r) %% 3L) %% 3L
    v <- c(as.integer(r), integer(pad))
    m <- matrix(v, nrow = 3L)
    w <- m[1, ] * 65536L + m[2, ] * 256L + m[3, ]
    idx <- rbind(w %/% 262144L, (w %/% 4096L) %% 64L, (w %/% 64L) %% 64L, w %% 64L)
    out <- chars[idx + 1L]
    if (pad > 0L) out[(length(out) - pad + 1L):length(out)] <- "="
    paste(out, collapse = "")
  }

  esc <- function(x) {
    x <- gsub("&", "&amp;", x, fixed = TRUE)
    x <- gsub("<", "&lt;", x, fixed = TRUE)
    gsub(">", "&gt;", x, fixed = TRUE)
  }

  html_table <- function(df, max_rows = 100L) {
    n <- nrow(df)
    d <- as.data.frame(if (n > max_rows) utils::head(df, max_rows) else df)
    cells <- vapply(d, function(col) esc(format(col)), character(nrow(d)))
    cells <- matrix(cells, nrow = nrow(d))
    head <- paste0("<tr><th></th>", paste0("<th>", esc(names(d)), "</th>", collapse = ""), "</tr>")
    rows <- if (nrow(d) > 0L) {
      paste0("<tr><th>", esc(rownames(d)), "</th>",
             apply(cells, 1L, function(r) paste0("<td>", r, "</td>", collapse = "")),
             "</tr>", collapse = "")
    } else ""
    more <- if (n > max_rows) sprintf("<p>%d rows x %d columns</p>", n, ncol(df)) else ""
    paste0("<table class=\"dataframe\" border=\"1\"><thead>", head, "</thead><tbody>", rows,
           "</tbody></table>", more)
  }

  value_bundle <- function(value) {
    text <- paste(utils::capture.output(print(value)), collapse = "\n")
    data <- list("text/plain" = text)
    if (is.data.frame(value)) {
      html <- tryCatch(html_table(value), error = function(e) NULL)
      if (!is.null(html)) data[["text/html"]] <- html
    }
    data
  }

  # Every page drawn during a cell is a PNG in plot_dir (no device call needed).
  options(device = function(...) {
    grDevices::png(file.path(plot_dir, sprintf("cell%d-%%03d.png", count)),
                   width = 720, height = 480, res = 96, type = "cairo")
  })
  options(warn = 1)

  plots <- function() {
    while (!is.null(grDevices::dev.list())) grDevices::dev.off()
    files <- sort(list.files(plot_dir, full.names = TRUE))
    out <- character(0)
    for (f in files) {
      size <- file.size(f)
      if (!is.na(size) && size > 0) {
        png <- readBin(f, "raw", size)
        out <- c(out, paste0("{\"ev\":\"display\",\"data\":",
                             jbundle(list("image/png" = b64(png), "text/plain" = "<plot>")), "}"))
      }
      unlink(f)
    }
    out
  }

  # ---- cells ----

  exception <- function(name, value, traceback = character(0)) {
    paste0("{\"ev\":\"exception\",\"name\":", jstr(name), ",\"value\":", jstr(value),
           ",\"traceback\":[", paste(vapply(traceback, jstr, ""), collapse = ","), "]}")
  }

  eval_top <- function(expr) {
    calls <- NULL
    tryCatch(
      withCallingHandlers(
        withVisible(eval(expr, globalenv())),
        error = function(e) calls <<- sys.calls()
      ),
      error = function(e) {
        call <- conditionCall(e)
        # A top-level stop() has the driver's eval() as its call.
        if (!is.null(call) && identical(paste(deparse(call), collapse = ""), "eval(expr, globalenv())")) {
          call <- NULL
        }
        head <- if (is.null(call)) paste0("Error: ", conditionMessage(e))
                else paste0("Error in ", paste(deparse(call, nlines = 1L), collapse = ""), ": ",
                            conditionMessage(e))
        frames <- vapply(calls, function(c) paste(deparse(c, nlines = 1L), collapse = ""), "")
        # The driver's own frames (eval_top's machinery) before the user's code.
        start <- match(TRUE, frames == "eval(expr, globalenv())", nomatch = 0L)
        frames <- frames[seq_along(frames) > start]
        frames <- frames[!grepl("^(withCallingHandlers|tryCatch|h\\(simpleError|.handleSimpleError|stop\\()", frames)]
        structure(list(name = class(e)[1], value = conditionMessage(e),
                       traceback = c(head, frames)), class = "ember_error")
      },
      interrupt = function(i) structure(list(), class = "ember_interrupt")
    )
  }

  run_cell <- function(msg) {
    count <<- count + 1L
    closing <- character(0)
    status <- "ok"
    saved <- apply_env(msg$env)
    if (identical(msg$reseed, "1")) reseed()
    result <- NULL
    outcome <- tryCatch({
      exprs <- tryCatch(parse(text = msg$code, keep.source = FALSE), error = function(e) e)
      if (inherits(exprs, "error")) {
        structure(list(name = "ParseError", value = conditionMessage(exprs),
                       traceback = conditionMessage(exprs)), class = "ember_error")
      } else {
        last <- NULL
        for (i in seq_along(exprs)) {
          r <- eval_top(exprs[[i]])
          if (inherits(r, "ember_error") || inherits(r, "ember_interrupt")) {
            last <- r
            break
          }
          last <- NULL
          if (isTRUE(r$visible)) {
            if (i == length(exprs) && !inherits(r$value, "ggplot")) {
              result <- tryCatch(value_bundle(r$value), error = function(e) {
                print(r$value)
                NULL
              })
            } else {
              print(r$value)
            }
          }
        }
        last
      }
    }, interrupt = function(i) structure(list(), class = "ember_interrupt"))
    closing <- c(closing, tryCatch(plots(), error = function(e) character(0)))
    if (inherits(outcome, "ember_error")) {
      status <- "error"
      closing <- c(closing, exception(outcome$name, outcome$value, outcome$traceback))
    } else if (inherits(outcome, "ember_interrupt")) {
      status <- "interrupted"
      closing <- c(closing, exception("KeyboardInterrupt", "interrupted"))
    } else if (!is.null(result)) {
      closing <- c(closing, paste0("{\"ev\":\"result\",\"data\":", jbundle(result),
                                   ",\"execution_count\":", count, "}"))
    }
    restore_env(saved)
    send(c(closing, paste0("{\"ev\":\"end\",\"status\":\"", status, "\",\"execution_count\":", count, "}")))
  }

  apply_env <- function(env) {
    saved <- lapply(names(env), function(k) Sys.getenv(k, unset = NA))
    names(saved) <- names(env)
    if (length(env)) do.call(Sys.setenv, env)
    saved
  }

  restore_env <- function(saved) {
    for (k in names(saved)) {
      if (is.na(saved[[k]])) Sys.unsetenv(k) else do.call(Sys.setenv, stats::setNames(list(saved[[k]]), k))
    }
  }

  # Fresh RNG state after a snapshot restore (clones would otherwise draw the same numbers).
  reseed <- function() {
    # raw = TRUE: a character device, read as bytes (file() would warn it is not a file).
    con <- file("/dev/urandom", open = "rb", raw = TRUE)
    on.exit(close(con))
    set.seed(readBin(con, "integer", 1L))
  }

  ready <- function() {
    send(paste0("{\"ev\":\"ready\",\"pid\":", Sys.getpid(), ",\"cwd\":", jstr(getwd()), "}"))
  }

  # ---- warm-up: one of each kind of cell before `ready` ----

  warm <- function() {
    df <- data.frame(a = 1:3, b = c(2.5, 1, 3))
    invisible(value_bundle(df))
    invisible(eval_top(quote(stop("warm-up"))))
    plot(df$a, df$b)
    if (requireNamespace("ggplot2", quietly = TRUE)) {
      print(ggplot2::ggplot(df, ggplot2::aes(a, b)) + ggplot2::geom_point())
    }
    invisible(plots())
  }
  suppressWarnings(try(warm(), silent = TRUE))
  # A full collection now: the next one is then far off. After a restore every heap page a
  # collection walks costs a fault (milliseconds each where guest memory faults are emulated),
  # and the context's first request would pay for them.
  invisible(gc(full = TRUE))
  ready()

  repeat {
    msg <- tryCatch(next_request(), interrupt = function(i) NULL)
    if (is.null(msg)) next
    if (identical(msg$op, "run")) {
      run_cell(msg)
    } else if (identical(msg$op, "setup")) {
      ok <- tryCatch({
        if (length(msg$env)) do.call(Sys.setenv, msg$env)
        if (!is.null(msg$cwd) && nzchar(msg$cwd)) setwd(msg$cwd)
        TRUE
      }, error = function(e) e)
      if (isTRUE(ok)) ready()
      else send(paste0("{\"ev\":\"error\",\"message\":", jstr(paste0(msg$cwd, ": ", conditionMessage(ok))), "}"))
    } else if (!identical(msg$op, "ack")) {
      send(paste0("{\"ev\":\"error\",\"message\":", jstr(paste0("unknown op ", msg$op)), "}"))
    }
  }
})

// puppeteer-core against `ember serve`'s CDP route (driven by tests/browser.rs).
// Environment: EMBER_URL, EMBER_TOKEN, SANDBOX_A, PAGE_URL, OUT_DIR, NODE_PATH (node_modules).
// Prints `OK <check>` per check; exits 1 with `FAIL <check>: <why>` on the first failure.
import { createRequire } from "node:module";
import fs from "node:fs";
import path from "node:path";

const require = createRequire(path.join(process.env.NODE_PATH, "x.js"));
const puppeteer = require("puppeteer-core");

const { EMBER_URL, EMBER_TOKEN, SANDBOX_A, PAGE_URL, OUT_DIR } = process.env;
function check(cond, what, why = "") {
  if (!cond) {
    console.log(`FAIL ${what}: ${why}`);
    process.exit(1);
  }
  console.log(`OK ${what}`);
}

const r = await fetch(`${EMBER_URL}/v1/sandboxes/${SANDBOX_A}/cdp`, {
  headers: { authorization: `Bearer ${EMBER_TOKEN}` },
});
check(r.ok, "GET /cdp", `HTTP ${r.status}`);
const version = await r.json();
check(/^ws:\/\//.test(version.webSocketDebuggerUrl), "webSocketDebuggerUrl", version.webSocketDebuggerUrl);
const browser = await puppeteer.connect({
  browserWSEndpoint: version.webSocketDebuggerUrl,
  defaultViewport: null,
  // Under kvm_pvm a restored sandbox's first screenshot or navigation costs its guest tens
  // of seconds of emulated kernel work.
  protocolTimeout: 600000,
});
const page = (await browser.pages())[0] ?? (await browser.newPage());
page.setDefaultTimeout(300000);
await page.goto(PAGE_URL, { timeout: 300000 });
check((await page.title()) === "ember test page", "test page loaded", await page.title());
await page.type("#q", "puppeteer");
await Promise.all([page.waitForNavigation({ timeout: 300000 }), page.click("#go")]);
const text = await page.$eval("#out", (e) => e.textContent);
check(text === "hello, puppeteer", "form result read", text);
await page.screenshot({ path: path.join(OUT_DIR, "puppeteer.png") });
check(fs.statSync(path.join(OUT_DIR, "puppeteer.png")).size > 0, "screenshot written");
await browser.disconnect();
console.log("DONE");

// The samples table: views, filter and sort, in the page itself (no library: works offline).
(function () {
  const table = document.getElementById("samples");
  const body = table.tBodies[0];
  const rows = Array.from(body.rows);
  const texts = rows.map((r) => r.textContent.toLowerCase()); // read once: 1,000 rows
  const filter = document.getElementById("filter");
  const only = document.getElementById("only");
  const shown = document.getElementById("shown");
  function apply() {
    const q = filter.value.trim().toLowerCase();
    let n = 0;
    rows.forEach((r, i) => {
      r.hidden = !(texts[i].includes(q) && (!only.value || r.classList.contains(only.value)));
      n += !r.hidden;
    });
    shown.textContent = n;
  }
  filter.addEventListener("input", apply);
  only.addEventListener("change", apply);
  const tabs = document.querySelectorAll("#views button");
  tabs.forEach((b) =>
    b.addEventListener("click", () => {
      table.dataset.view = b.dataset.view;
      tabs.forEach((t) => t.setAttribute("aria-pressed", String(t === b)));
    })
  );
  // Numbers as numbers ("70%" too), text in natural order (s2 before s10), blanks last; a
  // cell's data-sort, where it has one, instead of its text (the checks: refused before warn).
  const collator = new Intl.Collator(undefined, { numeric: true });
  function key(row, i) {
    const cell = row.cells[i];
    const t = (cell.dataset.sort ?? cell.textContent).trim();
    const x = parseFloat(t);
    return t === "" ? [2, 0] : isNaN(x) ? [1, t] : [0, x];
  }
  let sorted = -1;
  let dir = 1;
  table.tHead.addEventListener("click", (e) => {
    const th = e.target.closest("th");
    if (!th) return;
    const i = th.cellIndex;
    dir = i === sorted ? -dir : 1;
    sorted = i;
    const keyed = Array.from(body.rows, (r) => [key(r, i), r]);
    keyed.sort(([a], [b]) => {
      if (a[0] !== b[0]) return a[0] - b[0];
      const c = a[0] === 0 ? a[1] - b[1] : collator.compare(a[1], b[1]);
      return c * dir;
    });
    body.append(...keyed.map(([, r]) => r));
    table.querySelectorAll("thead th").forEach((h) => h.removeAttribute("aria-sort"));
    th.setAttribute("aria-sort", dir > 0 ? "ascending" : "descending");
  });
})();

from mmtrain.cli import main

raise SystemExit(main())
